"""Hypothesis: liveness on model time under any time scale.

Every clock of a run is ``epoch + (wall - epoch) * S``: the planner's ``Tick``
(services/drivers/serve.py ``ticker``) and each engine worker's node model (engine/worker/:
``EngineWorker`` turns the shared ``--clock-epoch`` into its ``WallClockHost`` epoch). The
worker heartbeats every ``heartbeat_s`` of wall clock, ``h = heartbeat_s * S`` model seconds;
``evolving up`` gives the planner a timeout of ``--heartbeat-timeout-s * S`` model seconds. A
node heartbeating every ``h < timeout`` model seconds (delivery delay included) is then never
removed, whatever ``S`` and however late the worker started; before the fix the engines
counted from their own start (no ``--clock-epoch``) and the timeout stayed in wall seconds,
so ``S > 1`` removed every engine.
"""

from __future__ import annotations

import argparse

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.worker.host import WallClockHost
from events.catalog import NodeHeartbeat, NodeRegistered, NodeRemoved, Tick
from services.cores.liveness import LivenessWatcher
from services.drivers.up.launch import plan_children
from services.drivers.up.options import UpSpec, add_up_args, up_spec
from tests.hyp import examples

EPOCH = 1.7e9


def engine_clock(scale: float, clock_epoch: float, started_wall: float):
    """The worker's model clock as ``EngineWorker.__init__`` builds it, at wall time ``w``."""
    wall = [started_wall]
    epoch = clock_epoch + (started_wall - clock_epoch) * scale  # EngineWorker's shared epoch
    host = WallClockHost(scale, emit=None, choose=None, peer=None, epoch=epoch,
                         monotonic=lambda: wall[0] - started_wall)

    def at(w: float) -> float:
        wall[0] = w
        return host.catch_up()
    return at


def tick_ts(scale: float, clock_epoch: float, w: float) -> float:
    return clock_epoch + (w - clock_epoch) * scale  # services/drivers/serve.py ticker


@settings(max_examples=examples(300), deadline=None)
@given(scale=st.one_of(st.sampled_from([0.5, 1.0, 2.0, 10.0, 100.0, 1000.0]), st.floats(0.05, 2000.0)),
       start_delay=st.floats(0.0, 60.0), heartbeat_s=st.floats(0.05, 2.0), slack=st.floats(1.05, 20.0),
       tick_s=st.floats(0.05, 3.0), delays=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
       duration=st.floats(5.0, 60.0))
def test_a_node_heartbeating_within_the_timeout_is_never_removed(scale, start_delay, heartbeat_s, slack, tick_s,
                                                                 delays, duration):
    # wall-clock budget: heartbeat period plus the worst delivery delay, times slack, is the timeout
    max_delay_s = heartbeat_s * 0.5
    timeout_wall = (heartbeat_s + max_delay_s) * slack
    w = LivenessWatcher(timeout_wall * scale)  # what `up` passes the planner: model seconds
    clock = engine_clock(scale, EPOCH, EPOCH + start_delay)
    arrivals: list[tuple[float, int, object]] = []  # (wall arrival, order, event)
    t0 = EPOCH + start_delay
    arrivals.append((t0, 0, NodeRegistered(ts=clock(t0), src="n1", node="n1", role="decode")))
    k, t = 0, t0
    while t < t0 + duration:
        t += heartbeat_s
        delay = delays[k % len(delays)] * max_delay_s
        arrivals.append((t + delay, 1, NodeHeartbeat(ts=clock(t), src="n1", node="n1", role="decode")))
        k += 1
    tw = EPOCH + tick_s
    while tw <= t:  # ticks while the node heartbeats (from before it started)
        arrivals.append((tw, 2, Tick(ts=tick_ts(scale, EPOCH, tw), src="planner")))
        tw += tick_s
    arrivals.sort(key=lambda a: (a[0], a[1]))
    removed = [out for _, _, ev in arrivals for out in w.apply(ev)]
    assert not any(isinstance(e, NodeRemoved) for e in removed), (scale, removed[:1])


@settings(max_examples=examples(100), deadline=None)
@given(scale=st.floats(0.05, 2000.0), start_delay=st.floats(0.0, 60.0), silent_wall=st.floats(1.1, 5.0))
def test_a_silent_node_is_removed_after_the_timeout_in_wall_seconds_at_any_scale(scale, start_delay, silent_wall):
    timeout_wall = 2.0
    w = LivenessWatcher(timeout_wall * scale)
    clock = engine_clock(scale, EPOCH, EPOCH + start_delay)
    t0 = EPOCH + start_delay
    w.apply(NodeRegistered(ts=clock(t0), src="n1", node="n1", role="decode"))
    w.apply(NodeHeartbeat(ts=clock(t0 + 1.0), src="n1", node="n1", role="decode"))
    assert w.apply(Tick(ts=tick_ts(scale, EPOCH, t0 + 1.0 + 0.9 * timeout_wall))) == []
    out = w.apply(Tick(ts=tick_ts(scale, EPOCH, t0 + 1.0 + silent_wall * timeout_wall)))
    assert [e.node for e in out] == ["n1"]


def _up_args(*argv: str) -> UpSpec:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return up_spec(p.parse_args(["--engines", "3", "--insecure", "--metrics-port", "-1", *argv]), clock_epoch=EPOCH)


@settings(max_examples=examples(30), deadline=None)
@given(scale=st.sampled_from(["0.5", "1", "2", "10", "100", "1000"]), timeout=st.sampled_from(["2", "10", "30"]))
def test_up_gives_every_engine_and_the_planner_one_clock_and_a_model_time_timeout(tmp_path_factory, scale, timeout):
    tmp = tmp_path_factory.mktemp("plan")
    children, _ = plan_children(_up_args("--time-scale", scale, "--heartbeat-timeout-s", timeout), "nats://x:1",
                                tmp, tmp / "r.duckdb")
    by = {c.name: c.cmd for c in children}
    opt = lambda cmd, k: cmd[cmd.index(k) + 1]
    planner = by["planner"]
    assert float(opt(planner, "--heartbeat-timeout-s")) == float(timeout) * float(scale)
    engines = [cmd for name, cmd in by.items() if name.startswith("engine-")]
    assert len(engines) == 3
    for cmd in engines:
        assert float(opt(cmd, "--clock-epoch")) == float(opt(planner, "--clock-epoch")) == EPOCH
        assert float(opt(cmd, "--time-scale")) == float(opt(planner, "--time-scale")) == float(scale)
        heartbeat_s = float(opt(cmd, "--heartbeat-s")) if "--heartbeat-s" in cmd else 1.0  # the worker's default
        assert heartbeat_s * float(scale) < float(opt(planner, "--heartbeat-timeout-s"))
