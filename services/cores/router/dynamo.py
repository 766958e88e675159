"""Dynamo's KV router cost (prefix overlap against load) on prefill workers.

Pure: no I/O, no clock, no randomness. Shares :class:`~services.cores.router.base.RouterBase` (same fold, re-routing on a switch, cold start) and routes decode round robin over the sorted decode nodes; no peer fetch (see docs/router.md for the defaults and their sources).
"""

from __future__ import annotations

from typing import Any, ClassVar

from events.catalog import NodeScore
from services.cores.router.base import RouterBase, local_choice
from services.cores.router.state import PREFILLING, QUEUED


class DynamoKvRouter(RouterBase):
    """Dynamo's KV router cost on prefill workers, lowest wins (ties to the node id)::

        cost_n = overlap_score_weight * prefill_blocks_n + decode_blocks_n
        prefill_blocks_n = (sum of t_uc outstanding on n + prompt - overlap_n * block) / block
        decode_blocks_n  = blocks of the requests outstanding on n + blocks of this request

    ``overlap_n`` is the prefix ``n`` holds itself (GPU or host memory; Dynamo reads no peer),
    so a cached prefix is a credit against the prefill term. Outstanding = routed to ``n`` and
    prefill not finished. Score: the cost.
    """

    default_name: ClassVar[str] = "dynamo_kv"
    defaults: ClassVar[dict[str, Any]] = {"overlap_score_weight": 1.0}

    def choose_prefill(self, r, candidates, lookup, now):
        bt = self.block_tokens
        prompt = self.prompt_tokens(r)
        own_blocks = -(-prompt // bt)
        scores = []
        for n in candidates:
            m = lookup.per_node.get(n) if lookup is not None else None
            overlap = min((m.local_blocks if m else 0) * bt, prompt)
            pending_uc, active_blocks = self._outstanding(n)
            prefill_blocks = (pending_uc + prompt - overlap) / bt
            cost = self.overlap_score_weight * prefill_blocks + active_blocks + own_blocks
            scores.append(NodeScore(node=n, score=cost, t_c=overlap, queue_s=self.state.wait_s(n, now)))
        best = min(scores, key=lambda s: (s.score, s.node))
        return local_choice(self, best.node, r, lookup, now, scores)

    def _outstanding(self, node: str) -> tuple[int, int]:
        ns = self.state.nodes[node]
        bt = self.block_tokens
        uc = blocks = 0
        for rid in ns.prefill_queue + ns.prefill_running:
            r = self.state.requests.get(rid)
            if r is not None and r.phase in (QUEUED, PREFILLING):
                uc += r.t_uc
                blocks += -(-r.prompt_tokens // bt)
        return uc, blocks
