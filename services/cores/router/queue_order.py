"""The wait a prefill node's queue order gives a new request, as the router predicts it. Pure:
no I/O, no clock (``now`` is the ts of the event being decided), no randomness.

Eq. 7's ``T_rem + sum(queue)`` is the wait of a first-come-first-served queue (SGLang's and
vLLM's default order, every baseline's). A node serving ``short_first``
(engine/backends/sim/prefill_order.py: shortest expected remaining prefill first, aging, a
long request held to a share of each iteration while a shorter one is eligible) runs a new
request after the work that sorts ahead of it only, not after the whole queue. Pricing such a
node as FCFS made the router shun every node that held a long cold prefill (a 300K-token
prompt is ~95 s of ``T_rem``) although a short request there waits for a bounded iteration,
and pile the short requests on the other nodes.

:func:`short_first_wait_s` predicts, for a request of predicted service ``own_s`` routed now:

- ahead of it: every running or queued request ``j`` whose key ``rem_j - aging * waited_j``
  is at most ``own_s`` (its own key: it has waited nothing), ``rem_j`` its predicted service
  left (a running request's service less the time since it started; past its prediction, the
  overrun so far, as state.py's ``T_rem``), ``waited_j`` the time
  since it joined the queue;
- a short request (``own_s <= long_s``): a long request (``rem_j > long_s``) is long only
  for its part above ``long_s``; while it is, it takes at most ``long_share`` of the node's
  time while the request is eligible. The long requests, in the engine's order (their keys),
  spend the long share of the short work on their parts above ``long_s``; one whose part
  above ``long_s`` ends within that share of ``short work ahead + own_s`` (the sum of the
  parts above of it and the long requests before it at most
  ``(short work ahead + own_s) * long_share / (1 - long_share)``) is then short, and if it
  sorts ahead of the request then (``long_s - aging * waited_j <= own_s``: both age alike
  from now on) it runs its last ``long_s`` whole, alone, ahead of the request. So the long
  requests add those tails whole plus
  ``min(sum of the rest of their rem_j, (short work ahead + own_s) * long_share / (1 - long_share))``;
  the short work ahead counts whole. (Charging the share alone missed the tails: a prompt
  that waited behind a cold wave has aged ahead of every later arrival by the time it is
  short, and the requests routed to its node waited its last ``long_s`` too.)
- a long request: the work ahead counts whole.

Requests that arrive later and sort ahead are not foreseen (as FCFS does not foresee a
priority hint). The constants are the engine's (the stack passes them).
"""

from __future__ import annotations

from services.cores.router.state import ClusterState

PREFILL_ORDERS = ("fcfs", "short_first")


def short_first_wait_s(state: ClusterState, node: str, now: float, own_s: float, aging: float,
                       long_s: float, long_share: float) -> float:
    """Predicted wait before a request of service ``own_s`` routed to ``node`` now finishes its
    share of the work ahead (module docstring). 0 for an idle node."""
    ns = state.nodes[node]
    reqs = state.requests
    short_ahead = long_ahead = long_total = 0.0
    longs: list[tuple[float, int, float, float]] = []  # (key, place, rem, waited) of each long request
    for rid in ns.prefill_running:
        r = reqs[rid]
        rem = abs(r.service_s - (now - r.started_ts))  # past its prediction: the overrun so far (state.py)
        waited = now - r.queued_ts
        short_ahead, long_ahead, long_total = _add(rem, rem - aging * waited, own_s, long_s,
                                                   short_ahead, long_ahead, long_total)
        if rem > long_s:
            longs.append((rem - aging * waited, len(longs), rem, waited))
    for rid in ns.prefill_queue:
        r = reqs[rid]
        rem = r.service_s
        waited = now - r.queued_ts
        short_ahead, long_ahead, long_total = _add(rem, rem - aging * waited, own_s, long_s,
                                                   short_ahead, long_ahead, long_total)
        if rem > long_s:
            longs.append((rem - aging * waited, len(longs), rem, waited))
    if own_s > long_s:
        return short_ahead + long_ahead
    if long_share >= 1.0:
        return short_ahead + long_total
    shared = (short_ahead + own_s) * long_share / (1.0 - long_share)
    tails = above = 0.0
    for _key, _place, rem, waited in sorted(longs):
        above += rem - long_s
        if above > shared:  # this one and those after it are still long when the request is done
            break
        if long_s - aging * waited <= own_s:  # short now, and aged ahead of the request
            tails += long_s
    return short_ahead + tails + min(long_total - tails, shared)


def _add(rem: float, key: float, own_s: float, long_s: float, short_ahead: float, long_ahead: float,
         long_total: float) -> tuple[float, float, float]:
    if rem > long_s:
        return short_ahead, long_ahead + (rem if key <= own_s else 0.0), long_total + rem
    return short_ahead + (rem if key <= own_s else 0.0), long_ahead, long_total
