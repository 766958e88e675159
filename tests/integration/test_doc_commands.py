"""Docs that cannot drift (issue 48 part 5): every shell command in a ```sh / ```bash / ```console
block of README.md and docs/*.md runs here, from a clone-like copy of the repository (tracked and
untracked-not-ignored files, no ../shared beside it, the repository's .venv on PATH).

A block runs as written unless an HTML comment on the lines just above its fence says otherwise:

    <!-- doc-test: skip (needs a GPU) -->          never runs here; the reason is required
    <!-- doc-test: heavy (a 20-minute benchmark) -->  too long for the default suite
    <!-- doc-test: only 3 (the others run full experiments) -->  run command 3 (1-based) only
    <!-- doc-test: stack (starts the live stack) -->  command 1 runs in the background with
        --ready-file, the rest run once the file is there, then command 1 gets SIGTERM

A block with neither a runnable command nor a declared reason fails `test_every_block_is_run_or_declared`.
Every fence names its language (`test_every_fence_is_tagged`): a bare ``` fails, naming file:line, so a
command cannot sit in a block nobody runs; output, schemas and pseudo-code are ```text. A non-shell
block whose lines read as shell commands (`$ `, `evolving ...`, `python -m ...` at the start of a
line) fails too: tag it sh / console and let it run or say why not.
Options in brackets (`[--quick]`) are left out. Long commands are shrunk by their own documented
flags (SHRINK: a stable prefix -> the flags replaced or added, and why). A console block's output
lines (after `$ command`) are checked by their first words, up to the first digit: a stable part.
`pytest -s` prints, per doc, how many commands ran, were shrunk, were declared skipped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LANGS = ("sh", "bash", "console", "shell")
DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(skip|heavy|only|stack)\s*([\d,]*)\s*\((.+)\)\s*-->")
TIMEOUT_S = 240

# The prefix is matched after the entry's own flags are taken out of the command.
# prefix -> (flags replaced or added, why, whether it reads what the block's earlier commands wrote: then
# they run first, shrunk, in the same case)
SHRINK: dict[str, tuple[dict[str, str], str, bool]] = {
    "evolving compare --trace deploy/traces/calibration --pace agent": (
        {"--agents": "4", "--duration": "20s", "--warmup": "10s"},
        "20 simulated minutes of 126 agents on four stacks are ~3 CPU-min; 4 agents for 30 s", False),
    "evolving replay --workload cc": (
        {"--agents": "4", "--duration": "20s", "--warmup": "10s"},
        "an hour (or 20 min) of 126 agents is minutes of CPU; 4 agents for 30 simulated seconds", False),
    "evolving compare --workload cc": (
        {"--agents": "6", "--duration": "40s", "--warmup": "20s", "--stacks": "evolving,static:4P5D"},
        "four stacks of 126 agents; two stacks of 6 agents for a simulated minute", False),
    "evolving sweep-static --workload putnam": (
        {"--agents": "8", "--duration": "30s", "--warmup": "10s"},
        "every static split of 256 agents for 30 minutes; 8 agents for 40 simulated seconds", False),
    "evolving sim-report": ({}, "reads the log that the replay before it wrote", True),
    "evolving up": ({"--gateway-port": "0"}, "port 8000 may be taken on a shared machine", False),
    "evolving bench recorder": ({"--requests": "200"}, "2,000 requests of 1,000 hashes in four writers: ~40 s; 200",
                                False),
}


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    body: list[str]
    kind: str = "run"
    which: tuple[int, ...] = ()
    reason: str = ""
    commands: list[tuple[str, list[str]]] = field(default_factory=list)  # (command, expected output)


def _strip_comment(line: str) -> str:
    """The line up to an unquoted `#` that starts a comment (after a blank)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _commands(block: Block) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    console = block.lang == "console"
    pending = ""
    heredoc: str | None = None
    for raw in block.body:
        if heredoc is not None:  # a here-document's lines belong to its command
            out[-1] = (out[-1][0] + "\n" + raw, [])
            if raw.strip() == heredoc:
                heredoc = None
            continue
        if console and not raw.startswith("$ ") and not pending:
            if out:
                out[-1][1].append(raw)
            continue
        text = raw[2:] if console and raw.startswith("$ ") else raw
        text = _strip_comment(text)
        if not text.strip() and not pending:
            continue
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        cmd = re.sub(r"\s*\[[^\]]*\]", "", (pending + text.strip()).strip())
        pending = ""
        if cmd:
            out.append((cmd, []))
            m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", cmd)
            heredoc = m.group(1) if m else None
    return out


@dataclass
class Fence:
    doc: str
    line: int
    lang: str
    body: list[str]


# a line that reads as a shell command (not indented: output tables indent their rows)
COMMANDISH = re.compile(r"^(\$ |(\w+=\S+ )*(nice -n \d+ )?(\.venv/bin/)?(evolving [a-z]|python3? -m |pytest |"
                        r"bash |docker |kubectl |cd ))")


def fences(text: str, name: str = "-") -> list[Fence]:
    """Every fenced block of a Markdown text, whatever its language ('' for a bare fence)."""
    lines = text.splitlines()
    out: list[Fence] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        out.append(Fence(name, i + 1, m.group(1), lines[i + 1:j]))
        i = j + 1
    return out


def untagged(all_fences: list[Fence]) -> list[str]:
    """What `test_every_fence_is_tagged` reports: bare fences, and commands in a block that never runs."""
    bad = []
    for f in all_fences:
        if not f.lang:
            bad.append(f"{f.doc}:{f.line}: a fence without a language")
        elif f.lang not in LANGS:
            hit = next((n for n, line in enumerate(f.body) if COMMANDISH.match(line)), None)
            if hit is not None and f.lang not in ("python", "sql", "toml", "json", "yaml"):
                bad.append(f"{f.doc}:{f.line + 1 + hit}: a shell command in a ```{f.lang} block, which never runs "
                           f"({f.body[hit].strip()[:60]!r})")
    return bad


def parse(doc: Path, root: Path = ROOT) -> list[Block]:
    return parse_text(doc.read_text(), str(doc.relative_to(root)))


def parse_text(text: str, name: str = "-") -> list[Block]:
    """The blocks that run (a language of ``LANGS``), each with the declaration above it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    for f in fences(text, name):
        if f.lang not in LANGS:
            continue
        b = Block(name, f.line, f.lang, f.body)
        k = f.line - 2  # the line above the fence
        while k >= 0 and (not lines[k].strip() or DIRECTIVE.search(lines[k])):
            d = DIRECTIVE.search(lines[k])
            if d:
                b.kind, b.reason = d.group(1), d.group(3).strip()
                b.which = tuple(int(x) for x in d.group(2).split(",") if x)
            k -= 1
        b.commands = _commands(b)
        blocks.append(b)
    return blocks


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


ALL = [b for d in docs() for b in parse(d)]
FENCES = [f for d in docs() for f in fences(d.read_text(), str(d.relative_to(ROOT)))]


def shrink(cmd: str) -> tuple[str, str | None]:
    for prefix, (flags, reason, _) in SHRINK.items():
        bare = cmd.removeprefix(".venv/bin/")  # the same command, spelled from the checkout
        for flag in flags:
            bare = re.sub(rf"\s{re.escape(flag)}[ =]\S+", "", bare)
        if bare.startswith(prefix):
            for flag, value in flags.items():
                if re.search(rf"\s{re.escape(flag)}[ =]\S+", cmd):
                    cmd = re.sub(rf"(\s{re.escape(flag)})[ =]\S+", rf"\1 {value}", cmd)
                else:
                    cmd = f"{cmd} {flag} {value}"
            return cmd, reason
    return cmd, None


def needs_earlier(cmd: str) -> bool:
    return any(cmd.startswith(prefix) and after for prefix, (_, _, after) in SHRINK.items())


def _cases():
    for b in ALL:
        if b.kind in ("skip", "heavy"):
            continue
        if b.kind == "stack":
            yield pytest.param(b, None, id=f"{b.doc}:{b.line}:stack", marks=pytest.mark.stack)
            continue
        for n, (cmd, _) in enumerate(b.commands, 1):
            if b.kind == "only" and n not in b.which:
                continue
            yield pytest.param(b, n, id=f"{b.doc}:{b.line}:{n}")


def test_every_block_is_run_or_declared():
    bad = []
    for b in ALL:
        if b.kind in ("skip", "heavy", "stack", "only") and not b.reason:
            bad.append(f"{b.doc}:{b.line}: doc-test {b.kind} without a reason")
        if b.kind == "run" and not b.commands:
            bad.append(f"{b.doc}:{b.line}: no command and no doc-test declaration")
        if b.kind == "only" and (not b.which or max(b.which) > len(b.commands)):
            bad.append(f"{b.doc}:{b.line}: doc-test only {b.which} names no command of the block")
    assert not bad, "\n".join(bad)


def test_every_fence_is_tagged():
    bad = untagged(FENCES)
    assert not bad, ("tag each block sh/bash/console (then it runs here, or a doc-test declaration says why "
                     "not) or text/sql/python/... (then it holds no command):\n" + "\n".join(bad))


def test_the_check_can_fail(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n```sh\n# only a comment\n```\n\n<!-- doc-test: heavy (long) -->\n```bash\na \\\n  b  # c\n```\n")
    a, b = parse(doc, tmp_path)
    assert (a.kind, a.commands) == ("run", [])
    assert (b.kind, b.reason, b.commands) == ("heavy", "long", [("a b", [])])
    assert shrink(".venv/bin/evolving up --engines torch")[0] == ".venv/bin/evolving up --engines torch --gateway-port 0"
    assert shrink("evolving replay --workload cc --agents 126 --out r.duckdb")[0] == \
        "evolving replay --workload cc --agents 4 --out r.duckdb --duration 20s --warmup 10s"
    text = "```\nevolving sql x\n```\n\n```text\n  evolving  881\n```\n\n```text\nout\n$ evolving up\n```\n"
    assert [b.split(": ")[0] for b in untagged(fences(text, "d.md"))] == ["d.md:1", "d.md:11"]
    assert untagged(fences("```sql\nSELECT 1\n```\n```console\n$ evolving sql\n```\n")) == []
    (c,) = parse_text("```sh\npython - <<'PY'\nprint(1)  # x\nPY\n```\n")
    assert c.commands == [("python - <<'PY'\nprint(1)  # x\nPY", [])]


def test_print_counts(capsys):
    per: dict[str, Counter] = {}
    for b in ALL:
        c = per.setdefault(b.doc, Counter())
        for n, (cmd, _) in enumerate(b.commands, 1):
            if b.kind in ("skip", "heavy") or (b.kind == "only" and n not in b.which):
                c["declared skipped"] += 1
            else:
                c["ran"] += 1
                c["shrunk"] += shrink(cmd)[1] is not None
    with capsys.disabled():
        for doc, c in per.items():
            print(f"\n{doc}: ran {c['ran']}, shrunk {c['shrunk']}, declared skipped {c['declared skipped']}", end="")
        print()
    assert per


@pytest.fixture(scope="session")
def clone(tmp_path_factory) -> Path:
    """The working tree as a fresh clone has it after scripts/setup.sh: its files, the compiled modules, .venv."""
    dest = tmp_path_factory.mktemp("clone") / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    # what scripts/setup.sh builds in place (`pip install -e .` compiles the Cython modules)
    built = subprocess.run(["git", "ls-files", "-oi", "--exclude-standard", "-z", "--", "*.so"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for f in filter(None, built):
        if not f.startswith("."):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    assert not (dest.parent / "shared").exists()
    return dest


def _env(clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "EI_"))}
    env["PATH"] = f"{clone / '.venv' / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(clone)  # the copy's code, not the editable install's checkout
    env["VIRTUAL_ENV"] = str(clone / ".venv")
    return env


def _check_output(cmd: str, expected: list[str], out: str) -> None:
    for line in expected[:3]:
        stable = re.split(r"\d", line.strip(), maxsplit=1)[0].strip()
        if len(stable) >= 6:
            assert stable in out, f"{cmd!r}: the docs show {line.strip()!r}; output lacks {stable!r}"


@pytest.mark.parametrize(("block", "n"), list(_cases()))
def test_documented_command(block: Block, n: int | None, clone: Path):
    env = _env(clone)
    if n is None:
        _run_stack(block, clone, env)
        return
    cmd, expected = block.commands[n - 1]
    if needs_earlier(cmd):
        for earlier, _ in block.commands[: n - 1]:
            p = subprocess.run(shrink(earlier)[0], check=False, shell=True, cwd=clone, env=env, capture_output=True,
                               text=True, timeout=TIMEOUT_S)
            assert p.returncode == 0, f"{earlier!r} (before {cmd!r}) exited {p.returncode}\n{p.stderr[-2000:]}"
    run, _ = shrink(cmd)
    p = subprocess.run(run, check=False, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"{block.doc}:{block.line}: {run!r} exited {p.returncode}\n{p.stderr[-2000:]}"
    _check_output(run, expected, p.stdout + p.stderr)


def _run_stack(block: Block, clone: Path, env: dict[str, str]) -> None:
    first, *rest = [shrink(c)[0] for c, _ in block.commands]
    expected = re.findall(r'prints "([^"0-9]+)', "\n".join(block.body))  # a stable part of what it says it prints
    ready = clone / "doc-test-ready.json"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(f"exec {first} --ready-file {shlex.quote(str(ready))}", shell=True, cwd=clone, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert proc.poll() is None, f"{first!r} exited {proc.returncode}: {proc.stdout.read()[-2000:]}"
            assert time.monotonic() < deadline, f"{first!r}: no ready file in {TIMEOUT_S} s"
            time.sleep(0.5)
        for cmd in rest:
            p = subprocess.run(cmd, check=False, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, f"{cmd!r} exited {p.returncode}\n{p.stderr[-2000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = " ".join(proc.stdout.read().split())  # log lines pad their columns
    assert proc.returncode in (0, -signal.SIGTERM), f"{first!r} did not stop cleanly on SIGTERM: {proc.returncode}"
    for part in expected:
        assert part in out, f"{first!r}: the docs say it prints {part!r}; it did not\n{out[-2000:]}"
