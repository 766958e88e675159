"""Least-predicted-TTFT router (METHOD.md §4.4, eq. 7). Pure: no I/O, no clock, no randomness.

For a request ``w`` and every prefill node ``n`` that takes prefill work now::

    T_hat_n(w) = T_rem_n + sum_{j in Q_n} T_req^{P,n}(w_j) + T_req^{P,n}(w)      (eq. 7)
    score_n    = T_hat_n(w) + max(0, T_fetch_n - (T_rem_n + sum_j T_req^{P,n}(w_j)))
                            + dup_cost_s_per_token * fetched_tokens_n

- ``t_c`` at ``n`` is the pool prefix: what ``n`` holds itself (L1 or L2) plus what it fetches
  from peers (the directory's ``pool_blocks``); ``t_uc`` is the rest of the prompt. Blocks in
  ``n``'s own host memory are restored at prefill start (``t_rst``, eq. 1's ``c3`` term);
  fetched blocks reach the GPU while the request waits (asynchronous fetch, §4.1).
- ``T_req^{P,n}`` is eq. 1 at ``n``'s model (``PRIOR_PREFILL`` until a ``ModelFitted``),
  chunked at ``n``'s token budget; ``T_rem_n`` and the queue are described in
  :mod:`services.router.state`.
- ``T_fetch_n = fetch_latency_s + fetched_tokens * fetch_s_per_token`` for the blocks
  ``[local_blocks(n), pool_blocks)``; only the part beyond the expected queue wait delays the
  prefill. The duplicate term charges the extra copy the fetch leaves in the pool.
- The least score wins, ties to the smallest node id. The decision carries ``t_c``, ``t_uc``,
  the fetch plan (which blocks from which peer, from the directory), the predicted TTFT
  (``T_hat`` plus the fetch excess) and every candidate's :class:`NodeScore`.

Decode node: the one with the least predicted time per output token if this request joins
it, ``T_iter^{D,d}(B_d + 1) / t_acc_d`` (eq. 2 at the node's model; ``B_d`` the requests
assigned to ``d`` and not finished; ``t_acc_d`` measured from ``IterationDone``), then the
fewest outstanding output tokens, then the node id.
"""

from __future__ import annotations

from typing import Any, ClassVar

from events.catalog import NodeScore
from services.directory.lookup import Lookup
from services.router.base import Choice, RouterBase
from services.router.state import RequestState

#: Fixed cost of one asynchronous fetch (RDMA setup and the GPU broadcast), seconds.
FETCH_LATENCY_S = 0.002
#: Peer L2 -> own L2 -> GPU per token: 16K tokens in ~8.5 ms with the latency, in line with
#: METHOD.md §4.1 (92 % of fetches under 16K tokens, median 7 ms).
FETCH_S_PER_TOKEN = 4.0e-7
#: Cost of the duplicate copy a fetch leaves, per fetched token (seconds-equivalent). About
#: 0.7 % of recomputing the token (``c1`` of the prior): enough to prefer the holder between
#: equally loaded nodes, far too little to pile requests on it. A project choice: Appendix E.3
#: gives the term, not its weight.
DUP_COST_S_PER_TOKEN = 2.0e-7


class LeastTtftRouter(RouterBase):
    """Evolving Infra's router: least predicted TTFT with asynchronous fetch from the pool."""

    default_name: ClassVar[str] = "evolving"
    defaults: ClassVar[dict[str, Any]] = {
        "fetch_latency_s": FETCH_LATENCY_S,
        "fetch_s_per_token": FETCH_S_PER_TOKEN,
        "dup_cost_s_per_token": DUP_COST_S_PER_TOKEN,
    }

    def choose_prefill(self, r: RequestState, candidates: list[str], lookup: Lookup | None,
                       now: float) -> Choice:
        bt = self.block_tokens
        prompt = self.prompt_tokens(r)
        pool = lookup.pool_blocks if lookup is not None else 0
        per_node = lookup.per_node if lookup is not None else {}
        t_c = min(pool * bt, prompt)
        t_uc = prompt - t_c
        state = self.state
        scores: list[NodeScore] = []
        best_key: tuple[float, str] | None = None
        best_ttft = 0.0
        best_fetch = 0
        for n in candidates:
            m = per_node.get(n)
            local, l1 = (m.local_blocks, m.l1_blocks) if m is not None else (0, 0)
            fetched = (pool - local) * bt if pool > local else 0
            t_rst = min((local - l1) * bt, t_c) if local > l1 else 0
            ns = state.nodes[n]
            service = state.prefill_model(n).request_s(t_uc, t_c, t_rst, ns.token_budget)
            wait = state.wait_s(n, now)
            excess = 0.0
            if fetched:
                excess = max(0.0, self.fetch_latency_s + fetched * self.fetch_s_per_token - wait)
            ttft = wait + service + excess
            score = ttft + self.dup_cost_s_per_token * fetched
            scores.append(NodeScore(node=n, score=score, t_c=t_c, queue_s=wait, fetch_excess_s=excess))
            key = (score, n)
            if best_key is None or key < best_key:
                best_key, best_ttft, best_fetch = key, ttft, fetched
        assert best_key is not None, "invariant: choose_prefill is called with at least one candidate"
        node = best_key[1]
        plan = lookup.fetch_plan(node) if best_fetch and lookup is not None else []
        return Choice(node=node, t_c=t_c, t_uc=t_uc, predicted_ttft_s=best_ttft, scores=scores,
                      fetch_plan=plan)

    def choose_decode(self, r: RequestState, candidates: list[str], now: float) -> str:
        state = self.state
        best: tuple[float, int, str] | None = None
        for d in candidates:
            ns = state.nodes[d]
            batch = len(ns.decode_assigned) + 1
            tpot = state.decode_model(d).iteration_s(batch, ns.t_fwd) / ns.t_acc()
            key = (tpot, ns.decode_tokens, d)
            if best is None or key < best:
                best = key
        assert best is not None, "invariant: choose_decode is called with at least one candidate"
        return best[2]
