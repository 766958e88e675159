"""The engine worker on a bus: registration, a request's life (collocated and split across two
workers), tokens to the gateway subject, role switch, clean stop; the process on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from engine.profiles import load_profile
from engine.worker.host import WallClockHost
from engine.worker.loop import EngineWorker
from events.catalog import (
    FirstToken,
    IterationDone,
    KvMoved,
    KvStored,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
    SwitchRole,
)
from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.bus.tokens import MemoryTokens, NatsTokens, sim_text

PROFILE = load_profile("gb300-glm52")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def wait_for_event(bus, pred, timeout: float = 10.0, start: int = 1):
    async def run():
        async with bus.consumer(None, start_seq=start) as c:
            async for d in c:
                if pred(d.event):
                    return d.event
    return await asyncio.wait_for(run(), timeout)


async def all_events(bus):
    out, head = [], await bus.last_seq()
    if head == 0:
        return out
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            out.append(d.event)
            if d.seq >= head:
                return out


def submit(request: str, max_tokens: int = 9, prompt_tokens: int = 300):
    blocks = [1000 + i for i in range(prompt_tokens // 64)]
    return RequestSubmitted(ts=0.0, src="test", request=request, branch="b", blocks=blocks,
                            prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def test_wall_clock_host_runs_callbacks_at_their_model_time():
    t = [0.0]
    ran = []
    host = WallClockHost(10.0, emit=ran.append, choose=None, peer=None, epoch=1000.0, monotonic=lambda: t[0])
    host.schedule(1000.5, lambda: ran.append(("a", host.now)))
    host.schedule(1002.0, lambda: ran.append(("b", host.now)))
    assert host.run_due() == 0
    t[0] = 0.1  # 1 model second later at scale 10
    assert host.run_due() == 1 and ran == [("a", 1000.5)]
    t[0] = 0.5
    assert host.run_due() == 1 and ran[-1] == ("b", 1002.0)
    assert host.catch_up() == pytest.approx(1005.0)
    with pytest.raises(ValueError):
        WallClockHost(0.0, emit=None, choose=None, peer=None)


async def test_collocated_request_switch_and_stop(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, time_scale=5.0, heartbeat_s=0.05)
    await w.start()
    reg = await wait_for_event(bus, lambda e: isinstance(e, NodeRegistered))
    assert (reg.node, reg.role, reg.profile, reg.l1_capacity_tokens) == ("n1", "collocated", "gb300-glm52",
                                                                         PROFILE.l1_capacity_tokens)
    sub = tokens_sub = await tokens.subscribe("r1")
    await bus.publish(submit("r1", max_tokens=9))
    await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="n1", decode_node="n1", policy="t"))
    fin = await wait_for_event(bus, lambda e: isinstance(e, RequestFinished))
    assert (fin.request, fin.node, fin.output_tokens) == ("r1", "n1", 9)
    msgs = []
    while True:
        m = await tokens_sub.get(5.0)
        msgs.append(m)
        if m.kind == "done":
            break
    await sub.close()
    assert msgs[0].kind == "first" and msgs[0].tokens == 1
    assert sum(m.tokens for m in msgs) == 9 and msgs[-1].total == 9
    assert "".join(m.text for m in msgs) == sim_text(9) and all(m.simulated for m in msgs)
    totals = [m.total for m in msgs]
    assert totals == sorted(totals)
    evs = await all_events(bus)
    kinds = {type(e) for e in evs}
    assert {RequestStarted, FirstToken, KvStored, IterationDone} <= kinds
    started = [e for e in evs if isinstance(e, RequestStarted)]
    assert [e.phase for e in started] == ["prefill", "decode"]
    stored = [e for e in evs if isinstance(e, KvStored) and e.request == "r1"]
    assert {b for e in stored for b in e.blocks} == set(submit("r1").blocks)
    # shadow routes and routes for other nodes are ignored
    await bus.publish(submit("r2"))
    await bus.publish(RouteDecided(ts=0.0, request="r2", prefill_node="n1", decode_node="n1", shadow=True))
    await bus.publish(RouteDecided(ts=0.0, request="r2", prefill_node="n9", decode_node="n9"))
    await bus.publish(SwitchRole(ts=0.0, node="n1", to_role="prefill"))
    sw = await wait_for_event(bus, lambda e: isinstance(e, RoleSwitched))
    assert (sw.node, sw.role, sw.kv_dropped) == ("n1", "prefill", False)
    assert w.node.role == "prefill"
    await wait_for_event(bus, lambda e: isinstance(e, NodeHeartbeat) and e.role == "prefill")
    await w.stop()
    evs = await all_events(bus)
    assert not any(isinstance(e, RequestStarted) and e.request == "r2" for e in evs)
    assert isinstance(evs[-1], NodeRemoved) and evs[-1].reason == "shutdown"


async def test_prefill_and_decode_workers_over_nats(nats_url, partition):
    buses = [await NatsBus.connect(nats_url, partition=partition) for _ in range(3)]
    ctl = buses[2]
    tokens = NatsTokens(ctl.nc, partition)
    wp = EngineWorker(buses[0], NatsTokens(buses[0].nc, partition), "p1", "prefill", PROFILE, time_scale=5.0)
    wd = EngineWorker(buses[1], NatsTokens(buses[1].nc, partition), "d1", "decode", PROFILE, time_scale=5.0)
    try:
        await wp.start()
        await wd.start()
        sub = await tokens.subscribe("rq")
        await ctl.publish(submit("rq", max_tokens=20, prompt_tokens=640))
        await ctl.publish(RouteDecided(ts=0.0, request="rq", prefill_node="p1", decode_node="d1", policy="t"))
        fin = await wait_for_event(ctl, lambda e: isinstance(e, RequestFinished))
        assert (fin.node, fin.output_tokens) == ("d1", 20)
        msgs = []
        while not msgs or msgs[-1].kind != "done":
            msgs.append(await sub.get(5.0))
        await sub.close()
        assert msgs[0].kind == "first" and msgs[0].node == "p1"
        assert msgs[-1].node == "d1" and sum(m.tokens for m in msgs) == 20
        evs = await all_events(ctl)
        moved = [e for e in evs if isinstance(e, KvMoved)]
        assert len(moved) == 1 and (moved[0].src_node, moved[0].dst_node) == ("p1", "d1")
        assert moved[0].blocks == submit("rq", prompt_tokens=640).blocks
        assert [(e.node, e.phase) for e in evs if isinstance(e, RequestStarted)] == [
            ("p1", "prefill"), ("d1", "decode")]
    finally:
        await wp.stop()
        await wd.stop()
        for b in buses:
            await b.close()


def test_sglang_backend_without_a_server_says_so_in_one_line():
    base = [sys.executable, "-m", "engine.worker", "--node", "n1", "--nats-url", "nats://x:1", "--backend", "sglang"]
    r = subprocess.run(base, check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--sglang-url" in r.stderr
    # a URL with nothing behind it (port 9 on loopback: discard, closed)
    r = subprocess.run(base + ["--sglang-url", "http://127.0.0.1:9"], check=False, capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "http://127.0.0.1:9" in r.stderr and "no SGLang server" in r.stderr


def test_sglang_help_documents_every_option():
    r = subprocess.run([sys.executable, "-m", "engine.worker", "--help"], check=True, capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    from engine.worker.__main__ import build_parser

    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in r.stdout
        assert action.help, f"{action.option_strings} has no help"


async def test_restart_resumes_from_its_snapshot_plus_tail(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, time_scale=20.0, heartbeat_s=0.05, snapshot_every=5)
    await w.start()
    await bus.publish(submit("r1", max_tokens=3))
    await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="n1", decode_node="n1", policy="t"))
    await wait_for_event(bus, lambda e: isinstance(e, RequestFinished))
    await w.stop()
    snap_seq = w.applied_seq
    assert await bus.get_snapshot("engine-n1") is not None and snap_seq > 5
    # events after the snapshot: a request submitted while the node is down, routed after its restart
    await bus.publish(submit("r2", max_tokens=2))
    w2 = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, time_scale=20.0, heartbeat_s=0.05)
    await w2.start()
    try:
        assert w2.restored_from == snap_seq
        assert "r2" in w2.view.requests and "r1" not in w2.view.requests
        await bus.publish(RouteDecided(ts=0.0, request="r2", prefill_node="n1", decode_node="n1", policy="t"))
        fin = await wait_for_event(bus, lambda e: isinstance(e, RequestFinished) and e.request == "r2")
        assert fin.node == "n1"
        evs = await all_events(bus)
        restarted = [e for e in evs if isinstance(e, NodeRemoved) and e.reason == "restarted"]
        assert restarted == []  # the first run said "shutdown": the directory knew it was gone
    finally:
        await w2.stop()


async def test_process_registers_and_stops_on_sigterm(nats_url, partition):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine.worker", "--node", "px", "--role", "decode", "--nats-url", nats_url,
        "--partition", partition, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    bus = await NatsBus.connect(nats_url, partition=partition)
    try:
        await wait_for_event(bus, lambda e: isinstance(e, NodeRegistered) and e.node == "px", timeout=30)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        gone = await wait_for_event(bus, lambda e: isinstance(e, NodeRemoved), timeout=10)
        assert (gone.node, gone.reason) == ("px", "shutdown")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await bus.close()


async def test_reroute_takes_a_queued_request_off_the_node(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "prefill", PROFILE, time_scale=20.0)
    await w.start()
    try:
        # a long prefill (200K tokens, ~12 chunked iterations) keeps "small" queued behind it
        await bus.publish(submit("big", max_tokens=2, prompt_tokens=200_000))
        await bus.publish(RouteDecided(ts=0.0, request="big", prefill_node="n1", decode_node="d9"))
        await wait_for_event(bus, lambda e: isinstance(e, RequestStarted) and e.request == "big")
        await bus.publish(submit("small", max_tokens=2))
        await bus.publish(RouteDecided(ts=0.0, request="small", prefill_node="n1", decode_node="d9"))
        await bus.publish(RouteDecided(ts=0.0, request="small", prefill_node="n2", decode_node="d9",
                                       reroute=True))
        await wait_for_event(bus, lambda e: isinstance(e, FirstToken) and e.request == "big", timeout=20)
        await asyncio.sleep(0.05)  # let the node's executor look at its queue once more
        evs = await all_events(bus)
        assert not any(isinstance(e, RequestStarted) and e.request == "small" for e in evs)
        assert w.node.pqueue == []
    finally:
        await w.stop()


async def test_a_fold_that_raises_is_logged_counted_and_the_stream_goes_on(partition, monkeypatch):
    """A fold that raises (a bug, a peer's state the node model did not expect) costs that one
    delivery: counted in ``fold_failed``, logged, the position moved past it, and the next
    request is served without the stream input reopening."""
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, time_scale=5.0, heartbeat_s=0.05)
    real_fold = w.fold

    def fold(seq, event):
        if isinstance(event, RouteDecided) and event.request == "bad":
            raise TypeError("a fold that raises")
        real_fold(seq, event)

    monkeypatch.setattr(w, "fold", fold)
    logged: list[str] = []

    class Log:  # structlog's signature: the message is the positional ``event``
        def __getattr__(self, level):
            def emit(event, **kw):
                logged.append(event)
            return emit

    monkeypatch.setattr("engine.worker.stream.log", Log())
    await w.start()
    try:
        await wait_for_event(bus, lambda e: isinstance(e, NodeRegistered))
        await bus.publish(submit("bad"))
        await bus.publish(RouteDecided(ts=0.0, request="bad", prefill_node="n1", decode_node="n1", policy="t"))
        await bus.publish(submit("good"))
        await bus.publish(RouteDecided(ts=0.0, request="good", prefill_node="n1", decode_node="n1", policy="t"))
        fin = await wait_for_event(bus, lambda e: isinstance(e, RequestFinished))
        assert fin.request == "good"
        assert w.metrics.fold_failed.labels("n1")._value.get() == 1
        assert w.applied_seq >= 4
        assert "fold_failed" in logged and "stream_input_failed" not in logged  # the input never reopened
    finally:
        await w.stop()
