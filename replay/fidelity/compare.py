"""The simulated side of ``evolving fidelity`` and the table both sides fill.

One stack's sessions run in the simulator (replay/sim/simulation.py) on the calibrated
profile, configured like the live run: as many nodes as live engines, the same planner and
router keywords (the stack's ``core_config``), the same sessions once each with the same
concurrency (``SimConfig.refill = False``, every agent starting at t = 0 as ``evolving drive``
starts its pool), and the planner's warm-up ending at the same time after the first request
as it did live (:func:`sim_warmup_s`).

Metrics (:func:`metrics_of`) come from each log alone through the simulator's own fold
(replay/sim/figures.py ``compute_metrics``), over the same window on both sides: from the first
``RequestSubmitted`` to the last ``RequestFinished`` (a finite, closed-loop workload: throughput
is its requests over that makespan).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from engine.profiles import Profile
from events.catalog import Event, RequestFinished, RequestSubmitted
from replay.sim.figures import RunMetrics, compute_metrics
from replay.sim.simulation import SessionSource, SimConfig, Simulation
from replay.sim.stacks import Stack
from replay.traces.format import Session

#: (metric, RunMetrics field, unit) in the table's order
METRICS = (("throughput_rps", "throughput_rps", "req/s"), ("ttft_p50_s", "ttft_p50_s", "s"),
           ("ttft_p95_s", "ttft_p95_s", "s"), ("e2e_mean_s", "e2e_mean_s", "s"), ("e2e_p95_s", "e2e_p95_s", "s"),
           ("prefix_hit", "kv_hit_actual", "share"), ("role_switches", "switches", "count"),
           ("finished", "finished", "requests"))
#: the metrics the issue's +-25% bar applies to
GATED = ("throughput_rps", "ttft_p50_s", "ttft_p95_s")
TOLERANCE = 0.25


def window(events: Sequence[Event]) -> tuple[float, float]:
    """First submission to last finish (module docstring)."""
    subs = [e.ts for e in events if isinstance(e, RequestSubmitted)]
    fins = [e.ts for e in events if isinstance(e, RequestFinished)]
    if not subs or not fins:
        return 0.0, 0.0
    return min(subs), max(fins) + 1e-6


def metrics_of(events: Iterable[Event], stack: str) -> RunMetrics:
    evs = list(events)
    t0, t1 = window(evs)
    return compute_metrics(evs, t0, t1, stack=stack)


def planner_offset_s(events: Sequence[Event]) -> float:
    """Seconds from the log's first event (where a live planner starts its warm-up clock) to the
    first request."""
    t0, _ = window(events)
    return max(0.0, t0 - events[0].ts) if events else 0.0


def sim_warmup_s(live_warmup_s: float, offset_s: float) -> float:
    """The simulated planner's warm-up: what was left of the live one at the first request
    (at least one tick, so the simulated planner has a warm-up end at all)."""
    return max(1.0, live_warmup_s - offset_s)


def run_sim(profile: Profile, stack: Stack, sessions: Sequence[Session], *, nodes: int, concurrency: int,
            warmup_s: float, planner_args: dict[str, Any], seed: int = 0,
            horizon_s: float = 3600.0) -> list[Event]:
    """The simulated run's events (module docstring)."""
    st = replace(stack, planner_args={**stack.planner_args, **planner_args, "warmup_s": warmup_s})
    cfg = SimConfig(nodes=nodes, duration_s=horizon_s, warmup_s=warmup_s, seed=seed, agents=concurrency,
                    stagger_s=0.0, refill=False)
    res = Simulation(profile, st, SessionSource(list(sessions)), cfg, keep_log=True).run()
    return res.log


def rows(stack: str, live: RunMetrics, sim: RunMetrics) -> list[dict]:
    """``{"stack", "metric", "live", "sim"}`` per metric (``--json``'s rows)."""
    out = []
    for name, fld, _unit in METRICS:
        lv, sv = getattr(live, fld), getattr(sim, fld)
        out.append({"stack": stack, "metric": name, "live": _clean(lv), "sim": _clean(sv)})
    return out


def _clean(x: float) -> float | int | None:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return round(x, 4) if isinstance(x, float) else x


def off_by(live: float | None, sim: float | None) -> float | None:
    """(sim - live) / live; None when either is missing or live is 0."""
    if live is None or sim is None or live == 0:
        return None
    return (sim - live) / live


def ranking(rows_: Sequence[dict], metric: str = "throughput_rps") -> tuple[list[str], list[str]]:
    """The stacks ordered by ``metric``, best first, live and simulated."""
    by = {r["stack"]: r for r in rows_ if r["metric"] == metric}
    key = lambda side: sorted(by, key=lambda s: -(by[s][side] or 0.0))
    return key("live"), key("sim")


#: two stacks whose ``metric`` differs by at most this share of the larger are tied: a difference
#: the run cannot tell from the machine's noise (live, one configuration served twice differed by
#: 2%: dynamo at 1P1D that never switches and static 1P1D) is no rank
TIE_TOLERANCE = 0.05


def order(a: float | None, b: float | None, tie: float = TIE_TOLERANCE) -> int:
    """1 if ``a`` ranks above ``b``, -1 below, 0 a tie (within ``tie`` of the larger, or missing)."""
    if a is None or b is None:
        return 0
    top = max(abs(a), abs(b))
    if top == 0 or abs(a - b) <= tie * top:
        return 0
    return 1 if a > b else -1


def same_ranking(rows_: Sequence[dict], metric: str = "throughput_rps", tie: float = TIE_TOLERANCE) -> bool:
    """Whether the stacks rank the same live and simulated: no pair is ordered one way live and
    the other way simulated. A tie on either side (:func:`order`) contradicts nothing."""
    by = {r["stack"]: r for r in rows_ if r["metric"] == metric}
    names = sorted(by)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            lv, sv = order(by[a]["live"], by[b]["live"], tie), order(by[a]["sim"], by[b]["sim"], tie)
            if lv * sv < 0:
                return False
    return True


def ranked(names: Sequence[str], rows_: Sequence[dict], side: str, metric: str = "throughput_rps",
           tie: float = TIE_TOLERANCE) -> str:
    """``names`` (already ordered best first on ``side``) joined by ``>``, or ``=`` between neighbours
    that tie: ``evolving > static:1P1D = dynamo``."""
    by = {r["stack"]: r[side] for r in rows_ if r["metric"] == metric}
    out = names[0] if names else ""
    for prev, cur in itertools.pairwise(names):
        out += f" {'=' if order(by[prev], by[cur], tie) == 0 else '>'} {cur}"
    return out
