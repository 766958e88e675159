"""End to end, the way Claude Code connects: the official ``anthropic`` client against
``evolving up`` (services, sim engines and the gateway as child processes) streams a tool-use
conversation with Claude Code's own session headers, then a sub-agent of that session asks its
own question. The recorded log, folded through a fresh directory core, holds one agent with a
sub-agent ("Done when"), every request finished, and ``evolving verify`` reproduces
every recorded decision."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.adapters.eventlog import DuckDbEventLog
from services.cores.directory.core import DirectoryCore
from services.drivers.up.testing import run_cli, stop_up, wait_ready_file

anthropic = pytest.importorskip("anthropic")

REPO = Path(__file__).resolve().parents[2]
SESSION, AGENT = "cc-3f2a", "cc-3f2a-explore-1"
TOOLS = [{"name": "read_file", "description": "Read a file of the repository",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def _stream_text(client, model: str, messages: list, headers: dict) -> tuple[str, list[str]]:
    kinds: list[str] = []
    with client.messages.stream(model=model, max_tokens=24, system="You are a coding agent.", tools=TOOLS,
                                messages=messages, extra_headers=headers) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    return "".join(b.text for b in final.content if b.type == "text"), kinds


@pytest.mark.stack
def test_the_anthropic_client_through_up_is_one_agent_with_a_sub_agent(nats_url, partition, tmp_path):
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "2", "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = wait_ready_file(ready, up, 120)
        client = anthropic.Anthropic(base_url=urls["gateway"], api_key="unused-without-keys", max_retries=0,
                                     timeout=60)
        model = client.models.list().data[0].id
        root = {"x-claude-code-session-id": SESSION}
        messages = [{"role": "user", "content": "Where is the planner's window closed?"}]
        first, kinds = _stream_text(client, model, messages, root)
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
        # the agent "called" a tool; the tool's answer comes back as a tool_result block
        messages += [{"role": "assistant", "content": [
                         {"type": "text", "text": first},
                         {"type": "tool_use", "id": "toolu_01", "name": "read_file",
                          "input": {"path": "services/cores/planner/window.py"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_01", "content": "def close(...): ..."}]}]
        second, _ = _stream_text(client, model, messages, root)
        assert second
        # Claude Code's budget: the sim engine ends the turn at a length drawn from real sessions
        # (engine/backends/sim/lengths.py, at most 15,390 tokens), not at 64,000 tokens
        sub = client.messages.create(model=model, max_tokens=64_000, tools=TOOLS,
                                     messages=[{"role": "user", "content": "List the planner's files."}],
                                     extra_headers={**root, "x-claude-code-agent-id": AGENT})
        assert sub.stop_reason == "end_turn" and sub.content[0].type == "text"
        assert 1 <= sub.usage.output_tokens <= 15_390
    finally:
        out = stop_up(up, 90)
    assert "stopped" in out
    db = run_dir / "run.duckdb"
    directory = DirectoryCore()
    with DuckDbEventLog(db, read_only=True) as log:
        for _seq, _subject, event in log.read():
            directory.apply(event)
        submitted = log.con.execute("SELECT payload->>'$.branch', count(*) FROM events "
                                    "WHERE type = 'RequestSubmitted' GROUP BY 1 ORDER BY 1").fetchall()
        failed = log.con.execute("SELECT count(*) FROM events WHERE type = 'RequestFinished' "
                                 "AND coalesce(payload->>'$.error', '') <> ''").fetchall()[0][0]
    assert submitted == [(SESSION, 2), (AGENT, 1)], submitted
    assert failed == 0
    assert directory.branch(SESSION)["parent"] is None
    agent = directory.branch(AGENT)
    assert agent["parent"] == SESSION and agent["mode"] == "subagent", agent
    assert sorted(directory.active_branches()) == sorted([SESSION, AGENT])  # Claude Code never ends them
    verify = run_cli("verify", str(db), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
