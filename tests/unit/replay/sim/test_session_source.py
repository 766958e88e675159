"""A recorded session's later passes (replay/sim/sessions.py): every block list is the elementwise
salt of the original's, whatever prefix of the previous list it reuses; generated sessions and
the cyclic collector (made with it paused, frozen inside a run)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np

from replay.sim.bench import _log_digest
from replay.sim.inputs import SimSpec, run_profile, sim_config
from replay.sim.runs import run_one
from replay.sim.sessions import SessionSource, _salt_blocks
from replay.sim.simulation import Simulation
from replay.sim.stacks import get_stack
from replay.traces.format import Compact, Fork, Request
from replay.traces.importers.weka import import_weka
from replay.traces.workloads import WORKLOADS

WEKA = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


def test_a_later_pass_salts_every_list_as_a_whole(monkeypatch):
    monkeypatch.setenv("EVOLVING_CACHE_DIR", "")
    sessions = import_weka(WEKA).sessions
    steps = [st for s in sessions for b in s.branches for st in b.steps]
    assert any(isinstance(st, Fork) for st in steps) and any(isinstance(st, Compact) for st in steps)  # resumes, rewrites
    src = SessionSource(sessions)
    for k in range(len(sessions), 3 * len(sessions)):
        orig, got = sessions[k % len(sessions)], src.get(k)
        c = k // len(sessions)
        assert got.id == f"{orig.id}~{c}"
        for bo, bg in zip(orig.branches, got.branches, strict=True):
            for so, sg in zip(bo.steps, bg.steps, strict=True):
                if isinstance(so, (Request, Compact)):
                    assert sg.blocks == _salt_blocks(so.blocks, c)
                    assert sg.blocks is not so.blocks
                else:
                    assert sg == so


def _cc(k: int):
    rng = np.random.Generator(np.random.PCG64([3, k]))
    return WORKLOADS["cc"].make(f"cc-{k}", rng, WORKLOADS["cc"].params)


def test_generation_pauses_the_collector_and_freezes_its_session_only_inside_a_run():
    seen: list[bool] = []

    def make(k: int):
        seen.append(gc.isenabled())
        return _cc(k)

    src = SessionSource(make=make)
    frozen = gc.get_freeze_count()
    assert gc.isenabled()
    s0 = src.get(0)
    assert seen == [False] and gc.isenabled()  # paused while making, given back
    assert gc.get_freeze_count() == frozen  # no run: nothing frozen
    assert s0 == _cc(0)
    src.frozen = True  # what run_one's _frozen_heap sets
    try:
        src.get(1)
        assert gc.get_freeze_count() > frozen  # the new session's lists among the frozen objects
    finally:
        src.frozen = False
        gc.unfreeze()
    gc.disable()
    try:
        src.get(2)
        assert seen[-1] is False and not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()


def test_run_one_gives_the_heap_back_and_decides_as_an_unfrozen_run():
    spec = SimSpec(nodes=2, agents=4, warmup=0.0, duration=120.0, workload="cc", seed=3)
    prof, cfg = run_profile(spec), sim_config(spec)
    want = Simulation(prof, get_stack("evolving"), SessionSource(make=_cc), cfg, keep_log=True).run()
    frozen = gc.get_freeze_count()
    src = SessionSource(make=_cc)
    _, res = run_one("evolving", spec, src, None, progress=False, keep_log=True)
    assert gc.get_freeze_count() == frozen and not src.frozen
    assert len(res.log) > 50
    assert _log_digest(res.log) == _log_digest(want.log)
    gc.freeze()  # a caller's own freeze (a server's start-up objects) is left as it was
    try:
        before = gc.get_freeze_count()
        run_one("evolving", spec, SessionSource(make=_cc), None, progress=False)
        assert 0 < gc.get_freeze_count() <= before  # not given back, nothing more frozen (some freed)
    finally:
        gc.unfreeze()
