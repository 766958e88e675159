"""Least-predicted-TTFT router (METHOD.md §4.4, eq. 7). Pure: no I/O, no clock, no randomness.

For a request ``w`` and every prefill node ``n`` that takes prefill work now::

    T_hat_n(w) = T_rem_n + sum_{j in Q_n} T_req^{P,n}(w_j) + T_req^{P,n}(w)      (eq. 7)
    score_n    = T_hat_n(w) + max(0, T_fetch_n - (T_rem_n + sum_j T_req^{P,n}(w_j)))
                            + dup_cost_s_per_token * fetched_tokens_n

- ``t_c`` at ``n`` is the pool prefix: what ``n`` holds itself (L1 or L2) plus what it fetches
  from peers (the directory's ``pool_blocks``); ``t_uc`` is the rest of the prompt. A node that
  cannot take in a fetch (``NodeState.fetch_in`` False: it registered a GPU tier and no host
  tier, where a fetch lands first) and every node with ``shared_pool`` False are priced with
  their own prefix only, and get no fetch plan: with no host tier the planned fetch never
  landed and the whole prefix was recomputed behind a prediction that assumed it cached
  (``bench dynamo --host-kv-tokens 0``: 108 of 950 requests, docs/experiments.md). Blocks in
  ``n``'s own host memory are restored at prefill start (``t_rst``, eq. 1's ``c3`` term);
  fetched blocks reach the GPU while the request waits (asynchronous fetch, §4.1).
- ``T_req^{P,n}`` is eq. 1 at ``n``'s model (``PRIOR_PREFILL`` until a ``ModelFitted``),
  chunked at ``n``'s token budget; ``T_rem_n`` and the queue are described in
  :mod:`services.cores.router.state`.
- ``T_fetch_n = latency + fetched_tokens * s_per_token`` for the blocks
  ``[local_blocks(n), pool_blocks)``, the :class:`~services.cores.costmodel.FetchModel` learned online
  from ``KvFetched`` (:class:`~services.cores.costmodel.FetchCostLearner`; ``fetch_latency_s`` and
  ``fetch_s_per_token`` are its prior); only the part beyond the expected queue wait delays the
  prefill. The duplicate term charges the extra copy the fetch leaves in the pool.
- ``prefill_order="short_first"`` (the evolving stack's, whose sim engines serve their queue
  shortest expected prefill first): the wait is the work that sorts ahead of the request and the
  long prefills' bounded share (:mod:`services.cores.router.queue_order`) instead of
  ``T_rem + sum(queue)``; the default ``"fcfs"`` is eq. 7 as written.
- The least score wins, ties to the smallest node id. The decision carries ``t_c``, ``t_uc``,
  the fetch plan (which blocks from which peer, from the directory), the predicted TTFT
  (``T_hat`` plus the fetch excess) and every candidate's :class:`NodeScore`.

Decode node: the one with the least predicted time per output token if this request joins
it, ``T_iter^{D,d}(B_d + 1) / t_acc_d`` (eq. 2 at the node's model; ``B_d`` the requests
assigned to ``d`` and not finished; ``t_acc_d`` measured from ``IterationDone``), then the
fewest outstanding output tokens, then the node id.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from events.catalog import Event, KvFetched, NodeScore
from services.cores.costmodel import FETCH_MIN_SAMPLES, FetchCostLearner, FetchModel, PrefillModel
from services.cores.directory.lookup import Lookup, NodeMatch
from services.cores.router.base import Choice, RouterBase
from services.cores.router.queue_order import PREFILL_ORDERS, short_first_wait_s
from services.cores.router.state import NodeState, RequestState

#: Prior fixed cost of one asynchronous fetch (RDMA setup and the GPU broadcast), seconds,
#: used until ``fetch_min_samples`` fetches were measured (``KvFetched``), then learned.
FETCH_LATENCY_S = 0.002
#: Prior peer L2 -> own L2 -> GPU per token: 16K tokens in ~8.5 ms with the latency, in line
#: with METHOD.md §4.1 (92 % of fetches under 16K tokens, median 7 ms); learned likewise.
FETCH_S_PER_TOKEN = 4.0e-7
#: Cost of the duplicate copy a fetch leaves, per fetched token (seconds-equivalent). About
#: 0.7 % of recomputing the token (``c1`` of the prior): enough to prefer the holder between
#: equally loaded nodes, far too little to pile requests on it. A project choice: Appendix E.3
#: gives the term, not its weight.
DUP_COST_S_PER_TOKEN = 2.0e-7
#: Up to this many prefill candidates every one is scored (and listed in ``RouteDecided.scores``);
#: above it only the holders of a prefix of the request and the least-loaded others that can
#: still win (:func:`_score_pruned`): the decision is the same, the cost stops growing with
#: the cluster. 16 keeps the full explanation for small clusters (and the pinned 9-node logs).
FULL_SCORING_MAX_NODES = 16


class LeastTtftRouter(RouterBase):
    """Evolving Infra's router: least predicted TTFT with asynchronous fetch from the pool."""

    default_name: ClassVar[str] = "evolving"
    defaults: ClassVar[dict[str, Any]] = {
        "fetch_latency_s": FETCH_LATENCY_S,
        "fetch_s_per_token": FETCH_S_PER_TOKEN,
        "dup_cost_s_per_token": DUP_COST_S_PER_TOKEN,
        "full_scoring_max_nodes": FULL_SCORING_MAX_NODES,
        "pack_slack": 0.0,
        "learn_fetch": True,
        "fetch_min_samples": FETCH_MIN_SAMPLES,
        # False: the data plane has no shared pool (node-local caches: a block another node holds
        # is recomputed, not fetched), so a node is priced with its own prefix only
        "shared_pool": True,
        # the prefill nodes' queue order (queue_order.py): "fcfs" prices a node's wait as eq. 7's
        # T_rem + sum(queue); "short_first" as the work that sorts ahead of the request, with the
        # engine's aging, long-request threshold and long share (the stack passes the engine's)
        "prefill_order": "fcfs",
        "order_aging": 1.0,
        "order_long_s": 5.0,
        "order_long_share": 0.5,
    }

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        slack = float(self.pack_slack)
        if not (math.isfinite(slack) and slack >= 0.0):
            raise ValueError(f"LeastTtftRouter: pack_slack must be a finite number >= 0, got {self.pack_slack!r}")
        self.pack_slack = slack
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"LeastTtftRouter: prefill_order must be one of {PREFILL_ORDERS}, "
                             f"got {self.prefill_order!r}")
        self.fetch = FetchCostLearner(FetchModel(float(self.fetch_latency_s), float(self.fetch_s_per_token)),
                                      min_samples=int(self.fetch_min_samples))

    @property
    def fetch_model(self) -> FetchModel:
        """The fetch cost the router charges now: learned from ``KvFetched``, the prior
        (``fetch_latency_s``, ``fetch_s_per_token``) until enough fetches were measured or
        with ``learn_fetch=False``."""
        return self.fetch.model if self.learn_fetch else self.fetch.prior

    def on_event(self, event: Event) -> None:
        f = self.fetch
        if isinstance(event, KvFetched):
            f.observe(event.dst_node, event.request, event.ts, event.duration_s,
                      len(event.blocks) * self.block_tokens)
        elif f.pending:
            f.advance(event.ts)

    def extra_snapshot(self) -> bytes:
        return _ENC.encode(self.fetch.to_state())

    def restore_extra(self, data: bytes) -> None:
        if data:
            self.fetch = FetchCostLearner.from_state(msgspec.msgpack.decode(data))

    def choose_prefill(self, r: RequestState, candidates: list[str], lookup: Lookup | None,
                       now: float) -> Choice:
        bt = self.block_tokens
        prompt = self.prompt_tokens(r)
        pool = lookup.pool_blocks if lookup is not None else 0
        per_node = lookup.per_node if lookup is not None else {}
        t_c = min(pool * bt, prompt)
        t_uc = prompt - t_c
        state = self.state
        nodes = state.nodes
        fm = self.fetch_model
        lat, fst, dup = fm.latency_s, fm.s_per_token, self.dup_cost_s_per_token
        local_only = not self.shared_pool
        # eq. 1 depends on the node only through its model, token budget and own prefix: one
        # evaluation per distinct (model, budget, local, l1) in a decision, not one per node
        services: dict[tuple, float] = {}

        def own_only(n: str) -> bool:
            """Only ``n``'s own prefix is cached for it (no pool, or ``n`` cannot take in a
            fetch: no host tier): a block another node holds is recomputed there."""
            return local_only or not nodes[n].fetch_in

        def service(n: str, local: int, l1: int, own: bool | None = None) -> float:
            ns = nodes[n]
            budget = ns.token_budget
            model = state.prefill_model(n)
            if own is None:
                own = local_only or not ns.fetch_in
            key = (id(model), budget, local, l1, own)
            s = services.get(key)
            if s is None:
                if own:  # only the node's own prefix is cached for it; the rest is computed
                    tc_n = min(local * bt, prompt)
                    t_rst = min((local - l1) * bt, tc_n) if local > l1 else 0
                    s = services[key] = model.request_s(prompt - tc_n, tc_n, t_rst, budget)
                else:
                    t_rst = min((local - l1) * bt, t_c) if local > l1 else 0
                    s = services[key] = model.request_s(t_uc, t_c, t_rst, budget)
            return s

        def score(n: str, wait: float, m: NodeMatch | None) -> _Scored:
            local, l1 = (m.local_blocks, m.l1_blocks) if m is not None else (0, 0)
            fetched = (pool - local) * bt if pool > local and not own_only(n) else 0
            excess = 0.0
            if fetched:
                excess = max(0.0, lat + fetched * fst - wait)
            ttft = wait + service(n, local, l1) + excess
            return ttft + dup * fetched, ttft, fetched, excess, wait

        scored: dict[str, _Scored] = {}
        if self.prefill_order == "short_first":  # the wait depends on the request: no pruning
            aging, long_s, share = float(self.order_aging), float(self.order_long_s), float(self.order_long_share)
            for n in candidates:
                m = per_node.get(n)
                own = service(n, *((m.local_blocks, m.l1_blocks) if m is not None else (0, 0)))
                scored[n] = score(n, short_first_wait_s(state, n, now, own, aging, long_s, share), m)
        elif len(candidates) <= self.full_scoring_max_nodes or dup < 0.0:
            for n in candidates:
                scored[n] = score(n, _wait(nodes[n], now), per_node.get(n))
        else:
            # the bound's service is the pool-priced one: no larger than a no-fetch node's own
            _score_pruned(candidates, nodes, per_node, now, score, lambda n, a, b: service(n, a, b, local_only),
                          state.prefill_model, scored, self.pack_slack)
        best_key: tuple[float, str] | None = None
        scores: list[NodeScore] = []
        for n in candidates:
            s = scored.get(n)
            if s is None:
                continue
            scores.append(NodeScore(node=n, score=s[0], t_c=_own_tc(per_node.get(n), bt, prompt) if own_only(n) else t_c,
                                    queue_s=s[4], fetch_excess_s=s[3]))
            key = (s[0], n)
            if best_key is None or key < best_key:
                best_key = key
        assert best_key is not None, "invariant: choose_prefill is called with at least one candidate"
        node = best_key[1]
        slack = self.pack_slack
        if slack > 0.0:
            node = _pack(scored, best_key, slack)
        _, best_ttft, best_fetch, _, _ = scored[node]
        plan = lookup.fetch_plan(node) if best_fetch and lookup is not None else []
        if own_only(node):
            t_c = _own_tc(per_node.get(node), bt, prompt)
            t_uc = prompt - t_c
        return Choice(node=node, t_c=t_c, t_uc=t_uc, predicted_ttft_s=best_ttft, scores=scores,
                      fetch_plan=plan)

    def choose_decode(self, r: RequestState, candidates: list[str], now: float) -> str:
        state = self.state
        nodes, model_of = state.nodes, state.decode_model
        iters: dict[tuple, float] = {}  # eq. 2 once per distinct (model, batch, t_fwd)
        # t_acc of a node that has not decoded yet: the candidates' pooled measurement (1.0
        # until any is measured). With 1.0 for it and ~2.6 measured elsewhere, an unmeasured
        # node looked 2.6x slower per token and never got a request, so never measured.
        acc = sum(nodes[d].accepted_tokens for d in candidates)
        req_it = sum(nodes[d].request_iterations for d in candidates)
        pooled = acc / req_it if acc > 0 and req_it > 0 else 1.0
        best: tuple[float, int, str] | None = None
        for d in candidates:
            ns = nodes[d]
            batch = len(ns.decode_assigned) + 1
            model = model_of(d)
            ik = (id(model), batch, ns.t_fwd)
            it = iters.get(ik)
            if it is None:
                it = iters[ik] = model.iteration_s(batch, ns.t_fwd)
            t_acc = ns.t_acc() if ns.accepted_tokens > 0 and ns.request_iterations > 0 else pooled
            tpot = it / t_acc
            key = (tpot, ns.decode_tokens, d)
            if best is None or key < best:
                best = key
        assert best is not None, "invariant: choose_decode is called with at least one candidate"
        return best[2]


_ENC = msgspec.msgpack.Encoder(order="deterministic")


def _own_tc(m: NodeMatch | None, bt: int, prompt: int) -> int:
    """Cached tokens of a node's own prefix (``shared_pool`` False)."""
    return min(m.local_blocks * bt, prompt) if m is not None else 0

#: (score, ttft, fetched tokens, fetch excess, wait) of one scored node.
_Scored = tuple[float, float, int, float, float]


def _pack(scored: dict[str, _Scored], best_key: tuple[float, str], slack: float) -> str:
    """Among the nodes whose score is within ``slack`` x the request's own prefill time (at the
    best node) of the best score, the one with the longest expected wait (then the lower score,
    then the id): a long request joins other long work instead of blocking the short queue that
    later short requests would use. A short request's tolerance is a fraction of a short time,
    so it still takes (nearly) the least predicted TTFT."""
    best_score, best = best_key
    _, ttft, _, excess, wait = scored[best]
    bound = best_score + slack * (ttft - wait - excess)
    pick = (-wait, best_score, best)
    for n, sc in scored.items():
        if sc[0] <= bound:
            pick = min(pick, (-sc[4], sc[0], n))
    return pick[2]


def _wait(ns: NodeState, now: float) -> float:
    """``ClusterState.wait_s`` inlined (same arithmetic, so the same float)."""
    rem = abs(ns.busy_until - now) if ns.prefill_running else 0.0
    return rem + ns.queue_s


def _score_pruned(candidates: list[str], nodes: dict[str, NodeState], per_node, now: float,
                  score: Callable[[str, float, NodeMatch | None], _Scored],
                  service: Callable[[str, int, int], float], model_of: Callable[[str], PrefillModel],
                  scored: dict[str, _Scored], slack: float = 0.0) -> None:
    """Score every holder of a prefix of the request, then the other candidates in increasing
    order of expected wait, only while one of them can still win or tie.

    Soundness: a candidate ``n`` holding nothing of the request scores
    ``fl(fl(fl(wait_n + S_n) + excess_n) + dup * fetched)`` with ``S_n`` its eq. 1 time for no own
    prefix, ``excess_n >= 0`` and ``dup * fetched >= 0`` (pruning is off for a negative
    ``dup_cost_s_per_token``). Rounding is monotone, so with ``S_min`` the least ``S`` over the
    (model, token budget) groups of these candidates, ``LB_n = fl(wait_n + S_min) <= score_n``,
    and ``LB`` never decreases along increasing ``wait``. Once ``LB_n`` exceeds the best score
    found, neither ``n`` nor any later candidate can win or tie (ties go to the smaller id, so
    an equal bound is still scored). The winner is the one full scoring picks.

    With ``pack_slack`` (:func:`_pack`) every node within ``best + slack * S_best`` must be
    scored. ``S_best <= score_best`` and the final best score is at most the best found so far,
    so stopping once ``LB_n > best * (1 + slack)`` (with a relative margin of 1e-9 against
    rounding) still scores every node the packing rule may pick.
    """
    rest: list[tuple[float, str]] = []
    best = float("inf")
    for n in candidates:
        wait = _wait(nodes[n], now)
        m = per_node.get(n)
        if m is not None and m.local_blocks > 0:
            s = scored[n] = score(n, wait, m)
            best = min(best, s[0])
        else:
            rest.append((wait, n))
    if not rest:
        return
    rest.sort()
    groups: dict[tuple, str] = {}  # one node per (prefill model, token budget) among the rest
    for _, n in rest:
        groups.setdefault((id(model_of(n)), nodes[n].token_budget), n)
    s_min = min(service(n, 0, 0) for n in groups.values())
    factor = (1.0 + slack) * (1.0 + 1e-9) if slack > 0.0 else 1.0
    for wait, n in rest:
        if wait + s_min > best * factor:
            break
        s = scored[n] = score(n, wait, None)
        best = min(best, s[0])

