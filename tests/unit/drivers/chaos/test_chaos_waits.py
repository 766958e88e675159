"""``evolving chaos``'s waits end on what the stream shows, not on a fixed time (once
1,830 requests counted "hung" under load while they were still finishing), and the CLI's
``--engines [sim|torch]`` / the engine faults' quick form."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from events.catalog import (
    FirstToken,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
    Tick,
)
from services.adapters.bus import Delivery
from services.drivers.chaos import cli
from services.drivers.chaos.load import NODES
from services.drivers.chaos.progress import Progress
from services.drivers.chaos.scenarios import scenarios
from services.drivers.chaos.suite import select, serve_a_while
from services.drivers.chaos.tail import Published, Tail
from services.drivers.chaos.torch_model import torch_worker_args


class _Tail(Tail):
    """The harness's copy of the stream without a bus: deliveries appended by the test."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.cursor = 0

    def add(self, *events) -> None:
        for ev in events:
            self.deliveries.append(Delivery(len(self.deliveries) + 1, "s", ev, {}))
            self.cursor = len(self.deliveries)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _hb(node="p0"):
    return NodeHeartbeat(ts=1.0, src=node, node=node, role="prefill")


def test_progress_counts_only_work_and_stalls_after_stall_s_without_any():
    tail, clock = _Tail(), _Clock()
    watch = Progress(tail, stall_s=45.0, clock=clock)
    clock.t += 44
    tail.add(_hb(), _hb(), Tick(ts=1.0, src="planner"))  # alive, but no request moved
    assert not watch.stalled() and watch.ticks == 1
    clock.t += 2
    assert watch.stalled()  # 46 s of heartbeats only: whatever is open has stopped
    tail.add(RequestStarted(ts=1.0, src="p0", request="r", node="p0", phase="prefill"))
    assert not watch.stalled() and watch.moves == 1  # work moved: the wait goes on
    clock.t += 40
    tail.add(FirstToken(ts=1.0, src="p0", request="r", node="p0"))
    clock.t += 40
    assert not watch.stalled()  # 80 s since the start of the row, 40 s since the last move
    clock.t += 6
    tail.add(RequestFinished(ts=1.0, src="d0", request="r", node="d0"))
    assert not watch.stalled() and watch.moves == 3


def test_a_slow_machine_that_keeps_finishing_requests_never_counts_as_stalled():
    """The 03:43 run's drain: requests finishing every few seconds for many minutes (the old
    240 s deadline counted the rest as hung)."""
    tail, clock = _Tail(), _Clock()
    watch = Progress(tail, stall_s=45.0, clock=clock)
    for i in range(200):  # 200 requests, one every 20 s: 4000 s
        clock.t += 20
        tail.add(RequestFinished(ts=1.0, src="p1", request=f"r{i}", node="p1"))
        assert not watch.stalled()
    assert watch.moves == 200


def test_progress_since_counts_work_that_arrived_before_the_watch():
    tail, clock = _Tail(), _Clock()
    tail.add(_hb())
    mark = len(tail.deliveries)
    tail.add(RequestFinished(ts=1.0, src="p1", request="r0", node="p1"))
    watch = Progress(tail, stall_s=45.0, since=mark, clock=clock)
    watch.poll()
    assert watch.moves == 1


class _Load:
    def __init__(self) -> None:
        self.published: list[Published] = []
        self.max_in_flight = None  # open loop, as the sim and torch runs


class _Stack:
    """What ``serve_a_while`` uses of the stack: the load, the tail and ``wait``."""

    def __init__(self, rate: float) -> None:
        self.rate, self.load, self.tail = rate, _Load(), _Tail()

    async def wait(self, pred, timeout_s, what, every_s=0.1):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await pred():
            if loop.time() > deadline:
                raise TimeoutError(what)
            await asyncio.sleep(every_s)


@pytest.mark.asyncio
async def test_serve_a_while_waits_for_the_requests_of_its_dwell_to_be_decided_not_for_a_time():
    import time

    stack = _Stack(rate=20.0)  # 0.5 s of load = 10 requests

    async def traffic(n: int, every_s: float) -> None:
        for i in range(n):
            ev = RequestSubmitted(ts=1.0, src="harness", request=f"r{i}", branch="b", blocks=[1], prompt_tokens=74)
            stack.load.published.append(Published(f"load:{i}", ev, i + 1, time.monotonic()))
            stack.tail.add(ev, RouteDecided(ts=1.0, src="router", request=f"r{i}", prefill_node="p0", decode_node="d0"))
            await asyncio.sleep(every_s)

    t0 = time.monotonic()
    feed = asyncio.create_task(traffic(12, 0.1))  # a slow machine: 10 requests take 1 s, not 0.5
    await serve_a_while(stack, 0.5)
    waited = time.monotonic() - t0
    await feed
    assert waited >= 0.9  # it waited for the 10 decisions, not 0.5 s
    assert stack.tail.decided_after(stack.load.published, t0) >= 10


def test_the_engine_quick_form_is_the_engine_faults_and_the_plain_quick_form_is_unchanged():
    known = scenarios()
    quick_engines = {s.name for s in select(known, quick=True, engines=True)}
    assert quick_engines == {"partition-engine", "kill-engine-prefill", "kill-engine-decode", "cut-kv-transfer",
                             "restart-gateway"}
    assert {s.name for s in select(known, quick=True)} == {s.name for s in known if s.quick}
    assert not {s.name for s in select(known, quick=True)} & {s.name for s in known if s.engines_only}


def _parse(*argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cli.register(sub, None)
    return p.parse_args(["chaos", *argv])


def test_engines_takes_an_optional_backend():
    assert _parse().engines is None
    assert _parse("--engines").engines == "sim"
    assert _parse("--engines", "--quick").engines == "sim"
    args = _parse("--engines", "torch", "--model", "m.gguf", "--quick")
    assert (args.engines, args.model, args.quick) == ("torch", "m.gguf", True)
    assert _parse("--engines", "vllm").engines == "vllm"
    with pytest.raises(SystemExit):
        _parse("--engines", "sglang")


def test_model_without_torch_engines_is_exit_2(capsys):
    args = _parse("--model", "m.gguf")
    assert args.func(args) == 2
    args = _parse("--engines", "--model", "m.gguf")
    assert args.func(args) == 2


def test_torch_workers_get_the_model_no_prompt_store_and_small_pools():
    args = torch_worker_args("/x/m.gguf")
    assert args[:2] == ["--backend", "torch"] and args[args.index("--model") + 1] == "/x/m.gguf"
    assert args[args.index("--prompt-store") + 1] == "off" and "--torch-ignore-eos" in args
    assert int(args[args.index("--torch-l1-blocks") + 1]) <= 4096


@pytest.mark.asyncio
async def test_the_stack_waits_for_every_worker_to_register(tmp_path):
    from services.drivers.chaos.supervisor import ChaosCluster

    stack = ChaosCluster(tmp_path, engines=True)
    stack.tail = _Tail()
    for node in ("p0", "p1", "d0"):
        stack.tail.add(NodeRegistered(ts=1.0, src=node, node=node, role="prefill"))
    assert not await stack.all_registered()  # d1 still loading its model: no fault yet
    stack.tail.add(NodeRegistered(ts=1.0, src="d1", node="d1", role="decode"))
    assert await stack.all_registered()


class _KillStack(_Stack):
    """What ``kill_engine`` uses of the stack. The tail reads on while the scenario awaits the
    bus (as the real one does): ``on_last_seq`` is what it reads then."""

    kv_bytes = False
    nodes = NODES

    def __init__(self, on_last_seq=()) -> None:
        super().__init__(rate=10.0)
        self.load.paused = False
        self.on_last_seq, self.killed = list(on_last_seq), []
        outer = self

        class _Bus:
            async def last_seq(self) -> int:
                outer.tail.add(*outer.on_last_seq)
                outer.on_last_seq = []
                return len(outer.tail.deliveries)

        self.bus = _Bus()

    async def wait(self, pred, timeout_s, what, every_s=0.1):
        await super().wait(pred, timeout_s, what, every_s)
        return asyncio.get_running_loop().time()  # the real one's: the time it held

    def kill_engine(self, node: str) -> None:
        self.killed.append(node)

    def spawn_engine(self, node: str, role: str) -> None:  # the restarted worker's first words
        self.tail.add(NodeRemoved(ts=9.0, src=node, node=node, reason="restarted"),
                      NodeRegistered(ts=9.0, src=node, node=node, role=role))

    async def caught_up(self, head: int) -> bool:
        return True

    async def decided_since(self, t: float) -> bool:
        return True


def _decoding_on_d0(stack: _KillStack, request: str) -> None:
    stack.tail.add(NodeRegistered(ts=1.0, src="d0", node="d0", role="decode"),
                   RequestStarted(ts=2.0, src="d0", request=request, node="d0", phase="decode"))


@pytest.mark.asyncio
async def test_a_victim_that_ends_while_the_scenario_awaits_the_head_counts_as_ended():
    """CI (606 s): kill-engine-decode reported "1 never ended" while no request of the run hung.
    The victim's end was read by the tail during ``await bus.last_seq()``, before a mark taken
    after that await; the ends are looked for from the mark on."""
    from services.drivers.chaos.accounting import ScenarioResult
    from services.drivers.chaos.engine_scenarios import kill_engine

    stack = _KillStack(on_last_seq=[RequestFinished(ts=3.0, src="d0", request="r1", node="d0", output_tokens=4)])
    _decoding_on_d0(stack, "r1")
    res = ScenarioResult("kill-engine-decode", "")
    await kill_engine("decode")(stack, res)
    assert stack.killed == ["d0"] and not stack.load.paused
    assert res.survived, res.detail
    assert "1 requests in decode: 1 re-routed and finished, 0 failed with an error, 0 never ended" in res.detail


@pytest.mark.asyncio
async def test_a_victim_that_never_ends_is_reported_so():
    """The same wait without the end: the row fails and says so (the wait stops when its
    deadline passes, shortened here through the stack's ``wait``)."""
    from services.drivers.chaos.accounting import ScenarioResult
    from services.drivers.chaos.engine_scenarios import kill_engine

    stack = _KillStack()
    _decoding_on_d0(stack, "r1")
    real_wait = stack.wait

    async def short_wait(pred, timeout_s, what, every_s=0.1):
        return await real_wait(pred, min(timeout_s, 0.3), what, every_s=0.01)

    stack.wait = short_wait
    res = ScenarioResult("kill-engine-decode", "")
    await kill_engine("decode")(stack, res)
    assert not res.survived and "1 never ended" in res.detail
