"""One directory instead of two (replay/sim/simulation.py, point 6): the router's lookups answered by the
directory core give the very log of the two-copy path (every event, decision and anomaly, in
order), on stacks that evict, fetch, switch in place, restart and drop KV."""

from __future__ import annotations

from dataclasses import replace

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.profiles import load_profile
from events.catalog import AnomalyReported, BranchOpened, KvEvicted, RequestSubmitted, RoleSwitched
from replay.sim.simulation import SimConfig, Simulation, _RouterDirectory
from replay.sim.stacks import get_stack
from replay.traces.workloads import generate
from tests.hyp import examples

PROFILE = load_profile("gb300-glm52")
SMALL = replace(PROFILE, l1_capacity_tokens=300_000, l2_capacity_tokens=900_000)  # evictions in a short run

_SESSIONS: dict[int, list] = {}


def _sessions(agents: int) -> list:
    if agents not in _SESSIONS:
        _SESSIONS[agents] = generate("cc", seed=1, agents=agents * 2)
    return _SESSIONS[agents]


def _sim(stack: str, share: bool, *, nodes=4, agents=10, seed=3, warmup=150.0, duration=90.0,
         profile=SMALL) -> Simulation:
    cfg = SimConfig(nodes=nodes, duration_s=duration, warmup_s=warmup, seed=seed, agents=agents,
                    share_directory=share)
    return Simulation(profile, get_stack(stack), _sessions(agents), cfg)


def _log(sim: Simulation) -> tuple[list[bytes], dict]:
    res = sim.run()
    return [type(e).__name__.encode() + msgspec.msgpack.encode(e) for e in res.log], res.anomalies


def test_the_shared_run_uses_one_directory_and_the_baseline_two():
    shared, two = _sim("evolving", True), _sim("evolving", False)
    assert isinstance(shared.cores[2].directory, _RouterDirectory)
    assert shared.cores[2].directory.core is shared.directory is shared.cores[0]
    assert two.cores[2].directory is not two.directory
    fast = Simulation(SMALL, get_stack("evolving"), _sessions(10),
                      SimConfig(nodes=4, duration_s=10, warmup_s=10, agents=10, directory_core=False))
    assert fast.directory is fast.cores[1].directory  # --fast: unchanged, the router's own copy


def test_evolving_log_identical_and_it_evicts_and_switches():
    shared = _sim("evolving", True)
    log, anomalies = _log(shared)
    assert (log, anomalies) == _log(_sim("evolving", False))
    events = shared.log
    assert any(isinstance(e, KvEvicted) for e in events), "the run must exercise eviction"
    assert any(isinstance(e, RoleSwitched) for e in events), "the run must exercise a role switch"


def test_baseline_stacks_identical_restart_drop_kv_and_data_plane_lookups():
    # dynamo: restart switches (KV dropped); arrow: in-place switch that drops KV; a baseline
    # router with the shared pool: the data plane's fetch plan comes from the directory core
    for stack in ("dynamo", "arrow", "static:2P2D+async"):
        assert _log(_sim(stack, True)) == _log(_sim(stack, False)), stack


def test_a_directory_anomaly_on_a_submission_keeps_its_place_in_the_log():
    logs = []
    for share in (True, False):
        sim = _sim("evolving", share)
        sim.start()
        sim.emit(BranchOpened(ts=0.0, src="t", branch="b1", mode="root"))
        sim.emit(RequestSubmitted(ts=0.0, src="t", request="r1", branch="nope", blocks=[1, 2, 3],
                                  prompt_tokens=200, max_tokens=5, version=0))
        sim.emit(RequestSubmitted(ts=0.0, src="t", request="r2", branch="b1", blocks=[1, 2, 3, 4],
                                  prompt_tokens=260, max_tokens=5, version=0))
        logs.append([msgspec.msgpack.encode(e) for e in sim.log])
        kinds = [(type(e).__name__, getattr(e, "component", None)) for e in sim.log]
        anomalies = [e for e in sim.log if isinstance(e, AnomalyReported)]
        assert any(a.component == "directory" and a.kind == "unknown_branch" for a in anomalies)
        first = kinds.index(("AnomalyReported", "directory"))
        assert kinds[first - 1][0] == "RequestSubmitted"  # the directory's output comes first
    assert logs[0] == logs[1]


@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), nodes=st.integers(2, 6),
       stack=st.sampled_from(["evolving", "evolving-restart", "memory-pool", "evolving-lru"]))
def test_shared_equals_two_copies_on_random_runs(seed, nodes, stack):
    kw = {"nodes": nodes, "agents": 2 * nodes, "seed": seed, "warmup": 80.0, "duration": 40.0}
    assert _log(_sim(stack, True, **kw)) == _log(_sim(stack, False, **kw))
