"""Dynamo's KV router cost (prefix overlap against load), as ai-dynamo 1.6.1 routes a
disaggregated deployment: its prefill router on prefill workers, its decode router on decode
workers.

Pure: no I/O, no clock, no randomness. Shares :class:`~services.cores.router.base.RouterBase` (same fold, re-routing on a switch, cold start); no peer fetch (see docs/router.md for the defaults and their sources).
"""

from __future__ import annotations

from typing import Any, ClassVar

from events.catalog import NodeScore
from services.cores.router.base import RouterBase, local_choice
from services.cores.router.state import PREFILLING, QUEUED


class DynamoKvRouter(RouterBase):
    """Dynamo's KV router cost, lowest wins (ties to the node id)::

        cost_n = overlap_score_weight * prefill_blocks_n [+ decode_blocks_n on a collocated node]
        prefill_blocks_n = (sum of t_uc outstanding on n + prompt - credit_n) / block
        credit_n         = GPU prefix_n + host_cache_hit_weight * host prefix_n   (tokens)
        decode_blocks_n  = blocks of the requests on n not finished + blocks of this request

    Outstanding = routed to ``n``, prefill not finished. A prefill-only node has no decode term:
    Dynamo derives its prefill router with ``router_track_active_blocks = false``
    (lib/mocker/src/replay/offline/disagg.rs ``derive_prefill_router_config``; the frontend's
    prefill router does the same), so only the prefill load and the overlap credit rank prefill
    workers. A collocated node (Dynamo's aggregated routing) keeps the active blocks, its
    decoding requests included (Dynamo frees them when the response completes). The decode
    node: Dynamo's decode router (``derive_decode_router_config``: no overlap credit, no prefill
    tokens, no KV reuse assumed) ranks by active blocks, so the decode node with the fewest
    blocks assigned and not finished wins. Score: the cost.
    """

    default_name: ClassVar[str] = "dynamo_kv"
    # overlap_score_weight: Dynamo's --router-kv-overlap-score-weight (1.6.1: the prefill load
    # scale, default 1.0); host_cache_hit_weight: --router-host-cache-hit-weight (default 0.75)
    defaults: ClassVar[dict[str, Any]] = {"overlap_score_weight": 1.0, "host_cache_hit_weight": 0.75}

    def choose_prefill(self, r, candidates, lookup, now):
        bt = self.block_tokens
        prompt = self.prompt_tokens(r)
        own_blocks = -(-prompt // bt)
        scores = []
        for n in candidates:
            m = lookup.per_node.get(n) if lookup is not None else None
            local, l1 = (m.local_blocks, m.l1_blocks) if m is not None else (0, 0)
            overlap = min(local * bt, prompt)
            credit = min(l1 + self.host_cache_hit_weight * (local - l1), local) * bt
            ns = self.state.nodes[n]
            collocated = "decode" in ns.phases()
            pending_uc, active_blocks = self._outstanding(n, collocated)
            prefill_blocks = max(0.0, pending_uc + prompt - min(credit, prompt)) / bt
            cost = self.overlap_score_weight * prefill_blocks
            if collocated:
                cost += active_blocks + own_blocks
            scores.append(NodeScore(node=n, score=cost, t_c=overlap, queue_s=self.state.wait_s(n, now)))
        best = min(scores, key=lambda s: (s.score, s.node))
        return local_choice(self, best.node, r, lookup, now, scores)

    def choose_decode(self, r, candidates, now):
        """The decode node with the fewest blocks assigned and not finished (ties to the id)."""
        return min(candidates, key=lambda n: (self._blocks(self.state.nodes[n].decode_assigned), n))

    def _blocks(self, rids) -> int:
        bt = self.block_tokens
        total = 0
        for rid in rids:
            r = self.state.requests.get(rid)
            if r is not None:
                total += -(-r.prompt_tokens // bt)
        return total

    def _outstanding(self, node: str, collocated: bool = False) -> tuple[int, int]:
        ns = self.state.nodes[node]
        bt = self.block_tokens
        uc = blocks = 0
        for rid in ns.prefill_queue + ns.prefill_running:
            r = self.state.requests.get(rid)
            if r is not None and r.phase in (QUEUED, PREFILLING):
                uc += r.t_uc
                blocks += -(-r.prompt_tokens // bt)
        if collocated:
            seen = set(ns.prefill_queue) | set(ns.prefill_running)
            blocks += self._blocks([rid for rid in ns.decode_assigned if rid not in seen])
        return uc, blocks
