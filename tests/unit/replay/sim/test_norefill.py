"""A run without refill (``SimConfig.refill=False``): every session of the trace runs
once, ``agents`` at a time, and the run ends when the last one has finished, as a peer's trace
replay does (Dynamo's ``replay_concurrency``). With refill a finished agent is replaced by a
re-salted copy of the pool (``~1`` ids) until the clock runs out."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.profiles import load_profile
from events.catalog import RequestFinished, RequestSubmitted
from replay.sim.simulation import SimConfig, Simulation
from replay.sim.stacks import get_stack
from replay.traces.format import Branch, End, Request, Session

PROFILE = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0)


def sessions(n: int, turns: int = 3) -> list[Session]:
    rng = np.random.default_rng(1)
    out = []
    for k in range(n):
        blocks: list[int] = []
        steps = []
        for _ in range(turns):
            blocks = blocks + [int(x) for x in rng.integers(1, 2**62, size=8)]
            steps.append(Request(blocks=list(blocks), tail_tokens=5, output_tokens=40, pause_s=2.0))
        out.append(Session(id=f"s{k}", branches=[Branch(id="root", steps=[*steps, End()])]))
    return out


def run(refill: bool, agents: int = 2, n: int = 5):
    cfg = SimConfig(nodes=2, warmup_s=0.0, duration_s=3600.0, seed=0, agents=agents, stagger_s=0.0, refill=refill)
    return Simulation(PROFILE, get_stack("static:1P1D"), sessions(n), cfg).run()


def test_every_session_once_and_the_trace_ends_the_run() -> None:
    res = run(refill=False)
    subs = [e for e in res.log if isinstance(e, RequestSubmitted)]
    assert res.submitted == res.finished == 15 and not res.unfinished
    assert len({e.request for e in subs}) == 15 and not any("~" in e.request for e in subs)
    assert {e.request.split(":")[0] for e in subs} == {f"a{k}" for k in range(5)}
    last = max(e.ts for e in res.log if isinstance(e, RequestFinished))
    assert last < 120.0 and max(e.ts for e in res.log) <= last + 1.0  # stopped at the end, not at 3600 s


def test_at_most_agents_sessions_at_a_time() -> None:
    res = run(refill=False, agents=2)
    live: set[str] = set()
    peak = 0
    by_req: dict[str, str] = {}
    left = {f"a{k}": 3 for k in range(5)}
    for e in res.log:
        if isinstance(e, RequestSubmitted):
            by_req[e.request] = a = e.request.split(":")[0]
            live.add(a)
            peak = max(peak, len(live))
        elif isinstance(e, RequestFinished):
            a = by_req[e.request]
            left[a] -= 1
            if not left[a]:
                live.discard(a)
    assert peak == 2


def test_refill_cycles_the_pool_until_the_clock_ends() -> None:
    res = run(refill=True, agents=2)
    subs = [e for e in res.log if isinstance(e, RequestSubmitted)]
    assert res.submitted > 15 and any("~" in e.request for e in subs)
