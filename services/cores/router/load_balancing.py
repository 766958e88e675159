"""Load-balancing baseline routers: round robin and least loaded (SGLang Model Gateway's ``round_robin`` / Dynamo's random-free load balancing).

Pure: no I/O, no clock, no randomness. Shares :class:`~services.cores.router.base.RouterBase` (same fold, re-routing on a switch, cold start) and routes decode round robin over the sorted decode nodes; no peer fetch (see docs/router.md for the defaults and their sources).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from services.cores.router.base import RouterBase, local_choice, node_score


class RoundRobinRouter(RouterBase):
    """Prefill nodes in turn (sorted ids); score = turns until the node's next pick."""

    default_name: ClassVar[str] = "round_robin"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rr_prefill = 0

    def choose_prefill(self, r, candidates, lookup, now):
        k = len(candidates)
        pick = self.rr_prefill % k
        self.rr_prefill += 1
        scores = [node_score(self, n, (i - pick) % k, r, lookup, now) for i, n in enumerate(candidates)]
        return local_choice(self, candidates[pick], r, lookup, now, scores)

    def extra_snapshot(self) -> bytes:
        return msgspec.msgpack.encode(self.rr_prefill)

    def restore_extra(self, data: bytes) -> None:
        self.rr_prefill = msgspec.msgpack.decode(data, type=int)


class LeastLoadedRouter(RouterBase):
    """The prefill node with the fewest outstanding prefill requests (queued + running)."""

    default_name: ClassVar[str] = "least_loaded"

    def choose_prefill(self, r, candidates, lookup, now):
        scores = [node_score(self, n, self.state.outstanding_prefill(n), r, lookup, now) for n in candidates]
        best = min(scores, key=lambda s: (s.score, s.node))
        return local_choice(self, best.node, r, lookup, now, scores)
