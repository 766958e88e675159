"""The measured prefill backlog of the recent slices: what the queue says
beside what the queueing model predicts. Pure: no I/O, no clock; sums exactly rounded
(``numerics.total``), so a replay on any machine takes the same decision.

The closed-loop queueing prediction (``evaluate.queue_prediction``) under-stated the queue the
shifting experiment measured about tenfold, and the throughput model sees no gain from more
prefill nodes while requests wait for prefill (they are not in decode, so the decode population
it is measured with is throttled by the queue). Over the recent slices, when a queue waited in
every one of them (a sustained backlog, not a burst):

- ``queue``: mean requests waiting for prefill (time-weighted, ``IterationDone.queued``);
  ``last_queue``: that of the last slice, the backlog a request arriving now waits behind;
- ``arrivals_rps``, ``wait_s = queue / arrivals_rps`` (Little: the measured mean wait);
- ``served_rps``: requests prefilled per second (prefilled uncached tokens / mean uncached
  tokens per routed request), ``node_rps``: per busy prefill node-second (the capacity of one
  node at this mix, measured, not modelled);
- ``growth_rps``: the backlog's growth (last slice's queue minus the first's, per second);
- ``wait_p95_s`` and ``spread``: the P95 of the prefill-queue waits of the requests whose
  prefill started in the slices (route to start) and its ratio to their mean (at least 1):
  the queue order (``short_first`` lets short requests pass) and the mix make the P95 several
  times the mean;
- ``demand_rps = served_rps + max(0, growth_rps)``: what arrived at prefill;
- ``need_prefill``: the fewest prefill nodes whose measured capacity serves the demand and
  drains the backlog within ``horizon_s`` (``P * node_rps >= demand_rps + last_queue /
  horizon_s``) and at which the backlog's P95 wait fits in it (``spread * last_queue /
  (P * node_rps) <= horizon_s``);
- ``fluid_wait_s(P)``: the P95 wait a request arriving now sees at P prefill nodes: the
  backlog ahead of it served at ``P * node_rps`` plus, when that is short of the demand, what
  the backlog grows by over the horizon, times ``spread``;
- ``projected(b, move_s)``: the backlog ``move_s`` seconds on at its measured growth (a growing
  backlog only), what a request arriving once a move ordered now has taken effect waits behind;
  ``deficit_wait_s(b, P, move_s)``: the P95 wait at P nodes once the backlog grew for
  ``move_s`` at the demand P nodes fall short of (the SLO guard of a move to fewer nodes).
"""

from __future__ import annotations

import math

import msgspec

import services.cores.numerics as nm
from events.catalog import Backlog
from services.cores.planner.window import SliceStats


def measure(
    slices: list[SliceStats], slice_s: float, horizon_s: float, n_nodes: int
) -> Backlog | None:
    """The backlog of ``slices`` (non-empty ones, in time order), or ``None`` when fewer than
    two are non-empty, a slice had no queue (mean under one request), or nothing arrived or was
    prefilled."""
    ss = [s for s in slices if not s.empty()]
    if len(ss) < 2 or n_nodes < 2:
        return None
    queues = [s.pre_queue / slice_s for s in ss]
    if min(queues) < 1.0:
        return None
    routed = sum(s.routed for s in ss)
    busy_s = nm.total([s.pre_busy_s for s in ss])
    t_uc = nm.total([s.sum_t_uc for s in ss]) / routed if routed else 0.0
    if t_uc <= 0.0 or busy_s <= 0.0 or not any(s.submitted for s in ss):
        return None
    span_s = len(ss) * slice_s
    served = nm.total([s.pre_t_uc for s in ss]) / t_uc
    queue = nm.total(queues) / len(queues)
    arrivals_rps = sum(s.submitted for s in ss) / span_s
    served_rps = served / span_s
    node_rps = served / busy_s
    growth_rps = (queues[-1] - queues[0]) / ((len(ss) - 1) * slice_s)
    demand_rps = served_rps + max(0.0, growth_rps)
    waited = sum(s.waited for s in ss)
    whole = SliceStats()
    for s in ss:
        whole.add(s)
    wait_p95_s = whole.wait_quantile_s(0.95)
    mean_wait_s = nm.total([s.sum_wait_s for s in ss]) / waited if waited else 0.0
    spread = max(1.0, wait_p95_s / mean_wait_s) if mean_wait_s > 0 else 1.0
    drain = (demand_rps + queues[-1] / horizon_s) / node_rps
    tail = spread * queues[-1] / (horizon_s * node_rps)
    need = min(n_nodes - 1, max(1, math.ceil(max(drain, tail) - 1e-9)))
    return Backlog(
        queue=queue,
        last_queue=queues[-1],
        arrivals_rps=arrivals_rps,
        wait_s=queue / arrivals_rps,
        served_rps=served_rps,
        node_rps=node_rps,
        growth_rps=growth_rps,
        demand_rps=demand_rps,
        wait_p95_s=wait_p95_s,
        spread=spread,
        horizon_s=horizon_s,
        need_prefill=need,
        n_slices=len(ss),
    )


def fluid_wait_s(b: Backlog, prefill_nodes: int) -> float:
    """The P95 wait of a request arriving now at ``prefill_nodes`` nodes of ``b.node_rps``
    each: the backlog ahead of it, plus its growth over the horizon when the capacity falls
    short, times the measured P95 / mean ``spread``."""
    cap = prefill_nodes * b.node_rps
    if cap <= 0.0:
        return math.inf
    return b.spread * (b.last_queue + max(0.0, b.demand_rps - cap) * b.horizon_s) / cap


def projected(b: Backlog, move_s: float) -> Backlog:
    """``b`` with its last slice's queue grown at ``growth_rps`` for ``move_s`` seconds (never
    shrunk: a draining backlog projects to itself)."""
    return msgspec.structs.replace(b, last_queue=b.last_queue + max(0.0, b.growth_rps) * move_s)


def deficit_wait_s(b: Backlog, prefill_nodes: int, move_s: float) -> float:
    """``fluid_wait_s`` at ``prefill_nodes`` once the backlog grew for ``move_s`` seconds by
    the demand their capacity falls short of (none when it does not)."""
    short = max(0.0, b.demand_rps - prefill_nodes * b.node_rps)
    return fluid_wait_s(msgspec.structs.replace(b, last_queue=b.last_queue + short * move_s), prefill_nodes)


def why(b: Backlog) -> str:
    return (
        f"measured backlog {b.last_queue:.0f} requests (mean {b.queue:.0f}, {b.growth_rps:+.2f}/s) over "
        f"{b.n_slices} slice(s), wait {b.wait_s:.1f} s (P95 of those started {b.wait_p95_s:.1f} s, "
        f"{b.spread:.1f}x their mean), {b.node_rps:.2f} req/s per prefill node at {b.demand_rps:.2f} req/s: "
        f"{b.need_prefill}P drain it within {b.horizon_s:g} s"
    )
