"""The real coding agents, unchanged and headless, against ``evolving up``,
each through a logging proxy (tests/integration/logging_proxy.py) that records what it sends.

- On the default ``evolving up`` (sim engines) Claude Code (``claude -p``), Codex (``codex
  exec``), opencode (``opencode run``) and mini-swe-agent finish their turn with only the base
  URL and a key configured; every request they send gets a 2xx; the stream folds each client's
  requests as one agent - one root branch named by the client's own session identity (Claude
  Code's session header, Codex's ``prompt_cache_key``, opencode's ``x-session-id``, and for
  mini-swe-agent, which sends none, the conversation its messages extend) - with no sub-agent,
  since none spawns one (the sim writes no tool calls); the prompt tokens on the stream are
  those the proxy log's measurement gives (docs/gateway.md, "Real clients").
- Claude Code, opencode and Codex given a scripted tool call that starts a sub-agent (the proxy
  answers that turn; the request still reaches the gateway): the sub-agent's requests are a
  ``subagent`` branch under the session on the stream (Codex's sub-agent tools are namespaced:
  the gateway renders them and reads a call back with its ``namespace``).
- opencode's title request (no tools, no prefix shared with the turn) runs on a side branch of
  its session, and the session's context is the turn's (no ``ContextCompacted``).
- On ``evolving up --engines torch:1`` mini-swe-agent completes a step (a ``bash`` call out of
  SmolLM2, forced with ``tool_choice: required`` in its model kwargs; the command's output in the
  next call).
- On ``evolving up --engines torch:1`` (SmolLM2-135M, 8,192 tokens) a prompt over the context is
  refused in each API's shape, before anything reaches the stream, and each client recognises
  the refusal as a prompt that is too long: Claude Code ``terminal_reason: prompt_too_long``,
  Codex "ran out of room in the model's context window", litellm (mini-swe-agent)
  ``ContextWindowExceededError``, opencode prints the message.

Not in the default suite (marker ``clients``: ``pytest -m clients``; scripts/test.sh runs it
after the load suite when the clients are installed: ``bash scripts/install_clients.sh``).
Skipped, with the reason, only where Node or a client is missing."""

from __future__ import annotations

import asyncio
import importlib.resources
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from engine.model_files import smollm2_gguf
from events.catalog import BranchEnded, BranchOpened, ContextCompacted, RequestFinished, RequestSubmitted
from events.wire import sim_text
from services.adapters.bus import NatsBus
from services.cores.directory.core import DirectoryCore
from services.drivers.gateway.model import AUTO, load_model
from services.drivers.up.testing import read_all, stop_up, wait_ready_file
from tests.integration.logging_proxy import (
    LoggingProxy,
    Record,
    anthropic_tool_use,
    openai_tool_call,
    prompt_tokens,
    responses_function_call,
)

pytestmark = pytest.mark.clients

REPO = Path(__file__).resolve().parents[2]
CLIENTS = Path(os.environ.get("EI_CLIENTS_DIR") or REPO / ".clients")
BIN = CLIENTS / "node_modules" / ".bin"
MINI = CLIENTS / "msa" / "bin" / "mini"
KEY = "sk-evolving-clients-test"
ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
#: A prompt of ~15,000 SmolLM2 tokens: over the torch engine's 8,192 with any client's own prompt.
LONG = "Summarise this: " + "lorem ipsum dolor sit amet " * 2200
CLIENT_TIMEOUT_S = 240


def _missing(binary: Path) -> str | None:
    if shutil.which("node") is None:
        return "Node.js is not installed (the npm clients need it)"
    if not binary.exists():
        return f"{binary} is not installed: bash scripts/install_clients.sh"
    return None


def _needs(binary: Path):
    """Skipped at collection, so that no ``evolving up`` starts for a client that is missing."""
    why = _missing(binary)
    return pytest.mark.skipif(why is not None, reason=why or "")


# ----------------------------------------------------------------------------- evolving up
def _up(nats_url: str, partition: str, run_dir: Path, *extra: str):
    ready = run_dir / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir / "run"), "--gateway-port", "0", "--ready-file", str(ready), "--no-status",
         "--metrics-port", "-1", "--stop-timeout-s", "15", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        return proc, wait_ready_file(ready, proc, 180)
    except BaseException:
        proc.kill()
        proc.communicate(timeout=30)
        raise


@pytest.fixture(scope="module")
def sim_up(nats_url, tmp_path_factory):
    """The default ``evolving up`` (sim engines) on the session's nats-server."""
    partition = f"clients-sim-{uuid.uuid4().hex[:8]}"
    proc, urls = _up(nats_url, partition, tmp_path_factory.mktemp("sim-up"))
    yield urls["gateway"], partition
    assert "stopped" in stop_up(proc, 90)


@pytest.fixture(scope="module")
def torch_up(nats_url, tmp_path_factory):
    """``evolving up --engines torch:1``: SmolLM2-135M-Instruct, a context of 8,192 tokens."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (scripts/setup.sh installs it unless EVOLVING_NO_TORCH=1)")
    partition = f"clients-torch-{uuid.uuid4().hex[:8]}"
    proc, urls = _up(nats_url, partition, tmp_path_factory.mktemp("torch-up"), "--engines", "torch:1")
    yield urls["gateway"], partition
    assert "stopped" in stop_up(proc, 90)


async def _read(nats_url: str, partition: str) -> list:
    bus = await NatsBus.connect(nats_url, partition)
    try:
        return [d.event for d in await read_all(bus)]
    finally:
        await bus.close()


def _stream(nats_url: str, partition: str, finished: set[str], timeout_s: float = 20.0) -> list:
    """The partition's events, once every request in ``finished`` has its ``RequestFinished``."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = asyncio.run(_read(nats_url, partition))
        done = {e.request for e in events if isinstance(e, RequestFinished)}
        if finished <= done or time.monotonic() > deadline:
            return events
        time.sleep(0.3)


# ----------------------------------------------------------------------------- the clients
def _env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no ANTHROPIC_* / OPENAI_* of the developer's, a HOME of its own."""
    home.mkdir(parents=True, exist_ok=True)
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TMPDIR", "TZ") if k in os.environ}
    return {**keep, "HOME": str(home), **extra}


def _run(cmd: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=False)


def claude(url: str, prompt: str, tmp: Path) -> subprocess.CompletedProcess:
    """``claude -p PROMPT --output-format json`` with ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY."""
    return _run([BIN / "claude", "-p", prompt, "--output-format", "json"],
                _env(tmp / "home", ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY=KEY), tmp / "work")


def codex(url: str, prompt: str, tmp: Path) -> subprocess.CompletedProcess:
    """``codex exec``: a provider with the base URL and the key's variable, its only wire API."""
    home = tmp / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        'model_provider = "evolving"\n\n[model_providers.evolving]\nname = "evolving"\n'
        f'base_url = "{url}/v1"\nenv_key = "EVOLVING_API_KEY"\nwire_api = "responses"\n')
    return _run([BIN / "codex", "exec", "--skip-git-repo-check", prompt],
                _env(tmp / "home", CODEX_HOME=str(home), EVOLVING_API_KEY=KEY), tmp / "work")


def opencode(url: str, prompt: str, tmp: Path) -> subprocess.CompletedProcess:
    """``opencode run``: an OpenAI-compatible provider in the project's opencode.json."""
    work = tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"evolving": {"npm": "@ai-sdk/openai-compatible", "name": "evolving",
                                  "options": {"baseURL": f"{url}/v1", "apiKey": KEY},
                                  "models": {"evolving-sim": {"name": "evolving-sim"}}}},
        "model": "evolving/evolving-sim"}))
    return _run([BIN / "opencode", "run", prompt], _env(tmp / "home"), work)


def mini(url: str, prompt: str, tmp: Path, *config: str) -> subprocess.CompletedProcess:
    """mini-swe-agent (litellm, OpenAI-compatible) for two steps: on the sim, which writes no
    tool call, each step is a turn the agent answers with its format-error message, then the
    limit. ``config``: more ``-c key=value`` settings."""
    env = _env(tmp / "home", OPENAI_BASE_URL=f"{url}/v1", OPENAI_API_KEY=KEY,
               # a model litellm has no price for (mini-swe-agent's local-model setting) and no
               # first-run configuration wizard; litellm's bundled price list, not a download
               MSWEA_COST_TRACKING="ignore_errors", MSWEA_CONFIGURED="true", LITELLM_LOCAL_MODEL_COST_MAP="True")
    return _run([MINI, "-m", "openai/evolving-sim", "-t", prompt, "--yolo", "--exit-immediately",
                 "-c", "mini.yaml", "-c", "agent.step_limit=2", *[a for c in config for a in ("-c", c)],
                 "-o", tmp / "traj.json"], env, tmp / "work")


def _generation(records: list[Record]) -> list[Record]:
    return [r for r in records if r.method == "POST" and r.path in ROUTES]


def _out(p: subprocess.CompletedProcess) -> str:
    return f"rc={p.returncode}\nstdout: {p.stdout[-3000:]}\nstderr: {p.stderr[-3000:]}"


# ----------------------------------------------------------------------------- one agent
def _one_agent(nats_url: str, partition: str, records: list[Record], branch: str | None,
               model=None) -> tuple[str, list]:
    """Every generation request of one client run got a 2xx on the same branch; on the stream
    that branch is one root agent with no child branch, every request was submitted on it with
    the prompt tokens the proxy log's measurement gives (``model``'s tokenizer and template; by
    default the sim stack's gateway's: ``--tokenizer auto``, the bundled model's), and finished
    without an error."""
    gen = _generation(records)
    assert gen, "the client sent no generation request"
    assert all(200 <= r.status < 300 for r in records), [(r.method, r.path, r.status, r.error_body)
                                                         for r in records if r.status >= 300]
    branches = {r.reply_headers["x-branch-id"] for r in gen}
    assert len(branches) == 1, branches
    (got,) = branches
    if branch is not None:
        assert got == branch
    ids = {r.reply_headers["x-request-id"]: r for r in gen}
    events = _stream(nats_url, partition, set(ids))
    directory = DirectoryCore()
    for ev in events:
        directory.apply(ev)
    opened = [e for e in events if isinstance(e, BranchOpened) and (e.branch == got or e.session == got)]
    assert [(e.branch, e.parent, e.mode) for e in opened] == [(got, None, "root")], opened
    view = directory.branch(got)
    assert view is not None and view["parent"] is None and view["mode"] == "root", view
    submitted = {e.request: e for e in events if isinstance(e, RequestSubmitted) and e.branch == got}
    assert set(submitted) == set(ids), (sorted(submitted), sorted(ids))
    model = model or load_model(AUTO)
    for rid, rec in ids.items():
        assert submitted[rid].prompt_tokens == prompt_tokens(rec.path, rec.json, model), rid
    finished = {e.request: e for e in events if isinstance(e, RequestFinished) and e.request in ids}
    assert set(finished) == set(ids) and all(not e.error and e.output_tokens > 0 for e in finished.values()), finished
    return got, events


def _agent_tree(nats_url: str, partition: str, by_branch: dict[str, list[str]], root: str, child: str) -> list:
    """On the stream: ``root`` a root agent and ``child`` a sub-agent under it (nothing else in
    that session but side branches, ``<branch>:side-...``, each under the branch it is named
    after: branches.is_side), each request submitted on the branch the gateway answered with, all
    finished."""
    ids = {i for v in by_branch.values() for i in v}
    events = _stream(nats_url, partition, ids)
    directory = DirectoryCore()
    for ev in events:
        directory.apply(ev)
    opened = {e.branch: e for e in events if isinstance(e, BranchOpened) and e.session == root}
    sides = {b: (b.split(":side-")[0], "subagent") for b in opened if ":side-" in b}
    assert {b: (e.parent, e.mode) for b, e in opened.items()} == {root: (None, "root"),
                                                                   child: (root, "subagent"), **sides}, opened
    assert directory.branch(child)["parent"] == root and directory.branch(child)["mode"] == "subagent"
    submitted = {e.request: e.branch for e in events if isinstance(e, RequestSubmitted) and e.request in ids}
    assert submitted == {i: b for b, v in by_branch.items() for i in v}
    finished = [e for e in events if isinstance(e, RequestFinished) and e.request in ids]
    # every request finished; one the client itself gave up (opencode aborts a side stream it no longer
    # needs: 'cancelled', seen once in a fresh-clone run) is the client's choice, not a failure
    assert len(finished) == len(ids) and not any(e.error and e.error != "cancelled" for e in finished)
    return events


# ----------------------------------------------------------------------------- sim: a turn each
@_needs(BIN / "claude")
def test_claude_code_finishes_a_turn_as_one_agent(sim_up, nats_url, tmp_path):
    url, partition = sim_up
    with LoggingProxy(url) as proxy:
        p = claude(proxy.url, "say hi", tmp_path)
    assert p.returncode == 0, _out(p)
    result = json.loads(p.stdout)
    assert (result["is_error"], result["terminal_reason"], result["stop_reason"]) == (False, "completed", "end_turn")
    assert result["result"].strip() and result["subagent_stats"]["spawned"] == 0
    records = proxy.snapshot()
    assert [(r.method, r.path, r.status) for r in records if r.path == "/api/hello"] == [("HEAD", "/api/hello", 200)]
    first = _generation(records)[0]
    session = first.headers["x-claude-code-session-id"]
    assert session == result["session_id"]
    # what it sends (docs/gateway.md, "Real clients"): a ~48 KB body asking 128,000 tokens
    assert first.path == "/v1/messages" and first.query == "beta=true" and first.json["max_tokens"] >= 64_000
    assert {"context_management", "output_config", "thinking", "metadata"} <= set(first.json)
    _one_agent(nats_url, partition, records, session)


@_needs(BIN / "claude")
def test_claude_codes_sub_agent_is_folded_under_its_session(sim_up, nats_url, tmp_path):
    """The sim never writes a tool call, so the proxy answers Claude Code's first turn with one
    (its ``Agent`` tool, in the foreground); the request itself still went to the gateway. Claude
    Code then runs the sub-agent - its requests add ``x-claude-code-agent-id`` - and the main
    agent's next turn carries the sub-agent's answer: on the stream, a root branch (the session)
    with its two turns and a sub-agent branch under it with its own."""
    url, partition = sim_up
    scripted: list[str] = []

    def agent_call(rec: Record):
        if rec.path != "/v1/messages" or "x-claude-code-agent-id" in rec.headers or scripted:
            return None
        scripted.append(rec.headers["x-claude-code-session-id"])
        return anthropic_tool_use(rec.json["model"], "Agent", {
            "description": "Say hi", "prompt": "say hi", "subagent_type": "general-purpose",
            "run_in_background": False})

    with LoggingProxy(url, script=agent_call) as proxy:
        p = claude(proxy.url, "use an agent to say hi", tmp_path)
    assert p.returncode == 0, _out(p)
    result = json.loads(p.stdout)
    stats = result["subagent_stats"]
    assert (result["terminal_reason"], stats["spawned"], stats["completed"]) == ("completed", 1, 1), result
    gen = _generation(proxy.snapshot())
    assert all(r.status == 200 for r in gen), [(r.path, r.status, r.error_body) for r in gen]
    (session,) = scripted
    agents = {r.headers["x-claude-code-agent-id"] for r in gen if "x-claude-code-agent-id" in r.headers}
    assert len(agents) == 1, agents
    (agent,) = agents
    by_branch: dict[str, list[str]] = {}
    for r in gen:
        assert r.headers["x-claude-code-session-id"] == session
        by_branch.setdefault(r.reply_headers["x-branch-id"], []).append(r.reply_headers["x-request-id"])
    assert {b: len(ids) for b, ids in by_branch.items()} == {session: 2, agent: 1}, by_branch
    events = _agent_tree(nats_url, partition, by_branch, session, agent)
    # the main agent's second turn extends its first (the tool call, then the agent's answer)
    assert not [e for e in events if isinstance(e, ContextCompacted) and e.branch in (session, agent)]


@_needs(BIN / "codex")
def test_codex_finishes_a_turn_as_one_agent(sim_up, nats_url, tmp_path):
    url, partition = sim_up
    with LoggingProxy(url) as proxy:
        p = codex(proxy.url, "say hi", tmp_path)
    assert p.returncode == 0, _out(p)
    assert sim_text(3) in p.stdout  # the sim's answer is the turn's final message
    records = proxy.snapshot()
    first = _generation(records)[0]
    assert first.path == "/v1/responses" and first.json["stream"] is True and first.json["store"] is False
    _one_agent(nats_url, partition, records, first.json["prompt_cache_key"])


@_needs(BIN / "codex")
def test_codexs_sub_agent_is_folded_under_its_session(sim_up, nats_url, tmp_path):
    """Codex 0.171 (its default model) lists its sub-agent tools in the namespace ``collaboration``
    of an ``additional_tools`` input item; the gateway renders them (``collaboration__spawn_agent``)
    and reads a call back as a ``function_call`` naming the namespace. The sim never writes one,
    so the proxy answers the main agent's first turn with ``spawn_agent`` and its second with
    ``wait_agent`` (the requests still reach the gateway). Codex runs the sub-agent in its own
    thread - ``thread-id`` beside the session's ``session-id``, the parent in
    ``x-codex-turn-metadata`` - and on the stream that is a sub-agent branch under the session;
    the main agent's third turn carries the sub-agent's answer."""
    from services.drivers.gateway.responses_api import parse_responses

    url, partition = sim_up
    scripted: list[str] = []

    def collaborate(rec: Record):
        meta = json.loads(rec.headers.get("x-codex-turn-metadata") or "{}")
        if rec.path != "/v1/responses" or meta.get("agent_name") != "/root" or len(scripted) >= 2:
            return None
        scripted.append(rec.headers["session-id"])
        if len(scripted) == 1:
            return responses_function_call(rec.json["model"], "spawn_agent", {
                "task_name": "say_hi", "message": "say hi", "fork_turns": "none"}, namespace="collaboration")
        return responses_function_call(rec.json["model"], "wait_agent", {"timeout_ms": 120_000},
                                       call_id="call_scripted_2", namespace="collaboration")

    with LoggingProxy(url, script=collaborate) as proxy:
        p = codex(proxy.url, "spawn an agent to say hi", tmp_path)
    assert p.returncode == 0, _out(p)
    gen = _generation(proxy.snapshot())
    assert all(r.status == 200 for r in gen), [(r.path, r.status, r.error_body) for r in gen]
    session = scripted[0]
    # what the model saw: the namespace's tools under their flat names (the code tool's namespace not)
    names = [t["name"] for t in parse_responses(json.dumps(gen[0].json).encode()).tools]
    assert {"collaboration__spawn_agent", "collaboration__wait_agent"} <= set(names), names
    children = {r.headers["thread-id"] for r in gen if r.headers["thread-id"] != session}
    assert len(children) == 1, [r.headers for r in gen]
    (child,) = children
    by_branch: dict[str, list[str]] = {}
    for r in gen:
        assert r.headers["session-id"] == session and r.reply_headers["x-branch-id"] == r.headers["thread-id"]
        by_branch.setdefault(r.reply_headers["x-branch-id"], []).append(r.reply_headers["x-request-id"])
    assert len(by_branch[session]) == 3 and by_branch[child], by_branch  # spawn, wait, the answer
    # the sub-agent got its task (Codex's agent_message item, rendered as a user message)
    first_child = next(r for r in gen if r.headers["thread-id"] == child)
    assert "say hi" in json.dumps(parse_responses(json.dumps(first_child.json).encode()).messages)
    events = _agent_tree(nats_url, partition, by_branch, session, child)
    assert not [e for e in events if isinstance(e, ContextCompacted) and e.branch in (session, child)]


@_needs(BIN / "opencode")
def test_opencode_finishes_a_turn_as_one_agent(sim_up, nats_url, tmp_path):
    url, partition = sim_up
    with LoggingProxy(url) as proxy:
        p = opencode(proxy.url, "say hi", tmp_path)
    assert p.returncode == 0, _out(p)
    assert sim_text(3) in p.stdout
    records = proxy.snapshot()
    gen = _generation(records)
    # its title request (no tools) and the agent's turn (its tools), both under its session id
    assert sorted(bool(r.json.get("tools")) for r in gen) == [False, True], [r.json.keys() for r in gen]
    assert all(200 <= r.status < 300 for r in records), [(r.path, r.status, r.error_body) for r in records]
    (title,) = [r for r in gen if not r.json.get("tools")]
    (turn,) = [r for r in gen if r.json.get("tools")]
    session = turn.headers["x-session-id"]
    assert title.headers["x-session-id"] == session and turn.reply_headers["x-branch-id"] == session
    # the title request shares no prefix with the turn: a side branch of the session, not a
    # rewrite of its context (whichever of the two the gateway admitted first)
    side = title.reply_headers["x-branch-id"]
    assert side.startswith(f"{session}:side-"), side
    ids = {turn.reply_headers["x-request-id"]: session, title.reply_headers["x-request-id"]: side}
    events = _stream(nats_url, partition, set(ids))
    opened = {e.branch: (e.parent, e.mode) for e in events if isinstance(e, BranchOpened) and e.session == session}
    assert opened == {session: (None, "root"), side: (session, "subagent")}, opened
    assert {e.request: e.branch for e in events if isinstance(e, RequestSubmitted) and e.request in ids} == ids
    finished = [e for e in events if isinstance(e, RequestFinished) and e.request in ids]
    assert len(finished) == 2 and not any(e.error for e in finished)
    assert not [e for e in events if isinstance(e, ContextCompacted) and e.branch == session]
    assert side in {e.branch for e in events if isinstance(e, BranchEnded)}


@_needs(BIN / "opencode")
def test_opencodes_sub_agent_is_folded_under_its_session(sim_up, nats_url, tmp_path):
    """The proxy answers opencode's first agent turn with a call of its ``task`` tool; opencode
    runs the sub-agent in a child session - its requests carry their own ``x-session-id`` and
    ``x-parent-session-id`` - and on the stream that is a sub-agent branch under the session."""
    url, partition = sim_up
    scripted: list[str] = []

    def task_call(rec: Record):
        if rec.path != "/v1/chat/completions" or not rec.json.get("tools") or scripted:
            return None
        scripted.append(rec.headers["x-session-id"])
        return openai_tool_call(rec.json["model"], "task", {"description": "Say hi", "prompt": "say hi",
                                                            "subagent_type": "general"})

    with LoggingProxy(url, script=task_call) as proxy:
        p = opencode(proxy.url, "use a task agent to say hi", tmp_path)
    assert p.returncode == 0, _out(p)
    gen = _generation(proxy.snapshot())
    assert all(r.status == 200 for r in gen), [(r.path, r.status, r.error_body) for r in gen]
    (session,) = scripted
    children = {r.headers["x-session-id"] for r in gen if r.headers.get("x-parent-session-id") == session}
    assert len(children) == 1, [r.headers for r in gen]
    (child,) = children
    by_branch: dict[str, list[str]] = {}
    for r in gen:  # a title request (no tools) runs on a side branch of its session (branches.is_side)
        want = r.headers["x-session-id"] if r.json.get("tools") else r.headers["x-session-id"] + ":side-"
        assert r.reply_headers["x-branch-id"].startswith(want), (want, r.reply_headers)
        by_branch.setdefault(r.reply_headers["x-branch-id"], []).append(r.reply_headers["x-request-id"])
    assert {session, child} <= set(by_branch) and len(by_branch[session]) >= 2, by_branch  # its turns
    events = _agent_tree(nats_url, partition, by_branch, session, child)
    assert not [e for e in events if isinstance(e, ContextCompacted) and e.branch == child]


@_needs(MINI)
def test_mini_swe_agent_steps_as_one_agent(sim_up, nats_url, tmp_path):
    url, partition = sim_up
    with LoggingProxy(url) as proxy:
        p = mini(proxy.url, "say hi", tmp_path)
    assert p.returncode == 0, _out(p)
    traj = json.loads((tmp_path / "traj.json").read_text())
    assert traj["info"]["exit_status"] == "LimitsExceeded", traj["info"]
    records = proxy.snapshot()
    gen = _generation(records)
    assert len(gen) == 2 and not any(k.startswith("x-") and "session" in k for k in gen[0].headers)
    # no session header: the second step's messages extend the first's, so one branch, no rewrite
    assert gen[1].json["messages"][: len(gen[0].json["messages"])] == gen[0].json["messages"]
    branch, events = _one_agent(nats_url, partition, records, None)
    assert branch.startswith("gw-")
    assert not [e for e in events if isinstance(e, ContextCompacted) and e.branch == branch]


# ----------------------------------------------------------------------------- torch: too long
SMOLLM2 = smollm2_gguf()


def _refused(records: list[Record]) -> list[tuple[Record, dict]]:
    gen = _generation(records)
    assert gen and all(r.status == 400 for r in gen), [(r.path, r.status) for r in gen]
    return [(r, json.loads(r.error_body or "{}")) for r in gen]


@pytest.mark.parametrize("client", [pytest.param(c, marks=_needs(MINI if c == "mini" else BIN / c))
                                    for c in ("claude", "codex", "opencode", "mini")])
def test_a_prompt_over_the_models_context_is_refused_in_each_apis_shape(client, torch_up, nats_url, tmp_path):
    url, partition = torch_up
    run = {"claude": claude, "codex": codex, "opencode": opencode, "mini": mini}[client]
    with LoggingProxy(url) as proxy:
        p = run(proxy.url, LONG, tmp_path)
    assert p.returncode != 0, _out(p)
    refused = _refused(proxy.snapshot())
    model = load_model(str(SMOLLM2))
    for rec, body in refused:
        n = prompt_tokens(rec.path, rec.json, model)
        assert n > 8192, n
        if rec.path == "/v1/messages":  # Anthropic's shape and wording, which Claude Code matches
            assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": f"prompt is too long: {n} tokens > 8191 maximum"}}
        else:  # OpenAI's (vLLM's) wording; the Responses API names its own field
            err = body["error"]
            asked = rec.json.get("max_tokens") or 1
            assert (err["type"], err["code"]) == ("invalid_request_error", "context_length_exceeded"), err
            assert err["param"] == ("input" if rec.path == "/v1/responses" else "messages")
            assert err["message"].startswith(f"This model's maximum context length is 8192 tokens. However, you "
                                             f"requested {n + asked} tokens ({n} in the "), err
    out = p.stdout + p.stderr
    if client == "claude":
        result = json.loads(p.stdout)
        assert (result["terminal_reason"], result["api_error_status"]) == ("prompt_too_long", 400), result
    elif client == "codex":
        assert "ran out of room in the model's context window" in out, _out(p)
    elif client == "opencode":
        assert "maximum context length is 8192 tokens" in out, _out(p)
    else:
        assert "ContextWindowExceededError" in out, _out(p)
    # refused before anything was published: no engine saw it
    events = asyncio.run(_read(nats_url, partition))
    assert not [e for e in events if isinstance(e, RequestSubmitted)]


@_needs(MINI)
def test_mini_swe_agent_completes_a_step_on_smollm2(torch_up, nats_url, tmp_path):
    """mini-swe-agent against ``evolving up --engines torch:1`` (SmolLM2-135M-Instruct): its first
    model call's answer is a ``bash`` tool call, the agent runs the command, and its second call
    carries the command's output; then the step limit (2). SmolLM2's chat template has no
    tool-call format, and left free (the same run without ``tool_choice``, measured: 29 s) it
    wrote text both times, which mini-swe-agent answered with its format-error message - no
    command ran. So the agent asks for a call the way its config allows, litellm's extra model
    kwargs: ``tool_choice: required`` (the gateway's structured decoding makes the answer one
    schema-valid ``bash`` call: docs/gateway.md, "Structured output") and ``max_tokens: 48``
    (SmolLM2 decodes ~6 tokens/s on this CPU)."""
    url, partition = torch_up
    t0 = time.monotonic()
    with LoggingProxy(url) as proxy:
        p = mini(proxy.url, "print the current directory", tmp_path,
                 "model.model_kwargs.tool_choice=required", "model.model_kwargs.max_tokens=48")
    took = time.monotonic() - t0
    assert p.returncode == 0, _out(p)
    traj = json.loads((tmp_path / "traj.json").read_text())
    assert traj["info"]["exit_status"] == "LimitsExceeded", traj["info"]
    gen = _generation(proxy.snapshot())
    assert len(gen) == 2 and all(r.status == 200 for r in gen), [(r.status, r.error_body) for r in gen]
    assert all((r.json["tool_choice"], r.json["max_tokens"]) == ("required", 48) for r in gen)
    msgs = traj["messages"]
    calls = [m for m in msgs if m["role"] == "assistant"]
    observations = [m for m in msgs if m["role"] == "tool"]
    assert len(calls) == 2 and len(observations) == 2, [m["role"] for m in msgs]
    for call in calls:  # each answer is one bash call with a command, which the agent ran
        (tc,) = call["tool_calls"]
        assert tc["function"]["name"] == "bash" and json.loads(tc["function"]["arguments"])["command"].strip()
    assert '"returncode"' in observations[0]["content"]
    # the second model call carries the first command's output
    sent = gen[1].json["messages"]
    assert next(m for m in sent if m["role"] == "tool")["content"] == observations[0]["content"]
    # one agent (no session header: the conversation folds, no rewrite), the prompt in SmolLM2's tokens
    branch, events = _one_agent(nats_url, partition, proxy.snapshot(), None, load_model(str(SMOLLM2)))
    assert not [e for e in events if isinstance(e, ContextCompacted) and e.branch == branch]
    assert took < 240, took
    print(f"mini-swe-agent, 2 steps on SmolLM2: {took:.1f} s")


def test_the_measurement_matches_what_the_gateway_counts():
    """The proxy log's measurement renders like the gateway: a Claude Code-shaped body's tokens
    with the byte tokenizer are the bytes of the rendered prompt (a check that needs no client)."""
    body = {"model": "claude-opus-4-8", "max_tokens": 10, "system": [{"type": "text", "text": "sys"}],
            "messages": [{"role": "user", "content": "hi"}]}
    n = prompt_tokens("/v1/messages", body, load_model(None))
    assert n == len(b"<|system|>\nsys<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n")
    with pytest.raises(ValueError, match="not a generation route"):
        prompt_tokens("/v1/models", body, load_model(None))
