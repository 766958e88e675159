"""Prestaging: the next turn's KV staged during the tool wait. Pure: no I/O,
no clock, no randomness.

After a turn of a branch finishes (``RequestFinished`` on its decode node ``D``), the agent
runs its tool for seconds to minutes; the branch's KV (prompt + output) sits on ``D``. A
prestaging router predicts where the branch's next turn will be prefilled and orders that KV
into the predicted node's host tier, so the next request finds it there (no fetch in its
critical path, the output tokens not recomputed):

- **The prediction** is the router's own choice (:meth:`RouterBase.choose_prefill`, which is
  side-effect free for every router here) for a hypothetical next request of the branch at
  the finish time: the finished request's prompt blocks, its prompt + output tokens (the
  output's block hashes are the engine's, not on the stream: the router charges those tokens
  as uncached everywhere), the same branch; candidates the nodes that take prefill now, ties
  on the sorted ids as in every decision.
- **The order** is a :class:`~events.catalog.KvStageOrdered` (request, branch, ``src_node=D``,
  ``dst_node`` the predicted node, tier ``L2``), one per finished request, none when the
  prediction is ``D`` itself (collocated: the KV is already there), when the request failed,
  when no node takes prefill, or in shadow (a shadow router orders nothing). The engines
  carry it out and report ``KvMoved`` (engine/backends/sim/node.py ``stage_in``): counts then
  follow the KV as for any cross-phase move (docs/directory.md).

The router keeps, per request in flight, what the prediction needs (branch, blocks, prompt
tokens) from its ``RequestSubmitted``; the entry goes at its ``RequestFinished``. Everything
comes from the stream, so ``evolving verify`` reproduces every order (it checks
``KvStageOrdered`` as a router decision). A router without this mixin never emits one: the
stacks without the part are unchanged, event for event.

On the live stack the router service runs a variant by its plug-in name and the part
(``evolving up --router evolving+prestage``: :func:`with_prestage` through
services/adapters/plugins.py); the worker of ``dst_node`` consumes the order from
``ei.<p>.route`` and its torch engine pulls the turn's blocks from the source's host tier
through the transfer port, as it does for a request's fetch (engine/backends/torch/peers.py,
"stage orders"; docs/live.md, "Next turn's KV staged live").
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from events.catalog import Event, KvStageOrdered, RequestFinished, RequestSubmitted
from services.cores.router.base import RouterBase
from services.cores.router.cache_aware import CacheAwareRouter
from services.cores.router.dynamo import DynamoKvRouter
from services.cores.router.least_ttft import LeastTtftRouter
from services.cores.router.load_balancing import LeastLoadedRouter
from services.cores.router.state import RequestState

_ENC = msgspec.msgpack.Encoder(order="deterministic")


class _Turn(msgspec.Struct, array_like=True):
    branch: str
    blocks: list[int]
    prompt_tokens: int


class PrestageMixin:
    """Adds the stage orders of the module docstring to a router (first in the bases)."""

    prestage_policy: ClassVar[str] = "prestage"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)  # type: ignore[call-arg]
        self.turns: dict[str, _Turn] = {}

    def apply(self, event: Event) -> list[Event]:
        if isinstance(event, RequestSubmitted):  # the turn is kept before the router folds it
            self.turns[event.request] = _Turn(event.branch, list(event.blocks), int(event.prompt_tokens))
        out = super().apply(event)  # type: ignore[misc]
        if isinstance(event, RequestFinished):
            turn = self.turns.pop(event.request, None)
            if turn is not None and not event.error and not self.shadow:  # type: ignore[attr-defined]
                order = self.stage_order(event, turn)
                if order is not None:
                    out.append(order)
        return out

    def predict_next(self, turn: _Turn, output_tokens: int, now: float):
        """The router's choice for the branch's hypothetical next request (module docstring),
        or ``None`` when no node takes prefill."""
        router: RouterBase = self  # type: ignore[assignment]
        candidates = router.state.eligible("prefill")
        if not candidates:
            return None
        hyp = RequestState(request="", branch=turn.branch, prompt_tokens=turn.prompt_tokens + max(0, output_tokens),
                           blocks=turn.blocks, submitted_ts=now)
        lookup = router.directory.lookup(turn.blocks, turn.branch or None) if turn.blocks else None
        return router.choose_prefill(hyp, candidates, lookup, now)

    def stage_order(self, ev: RequestFinished, turn: _Turn) -> KvStageOrdered | None:
        choice = self.predict_next(turn, ev.output_tokens, ev.ts)
        if choice is None or choice.node == ev.node:
            return None
        return KvStageOrdered(ts=ev.ts, src=self.name, request=ev.request, src_node=ev.node,  # type: ignore[attr-defined]
                              dst_node=choice.node, branch=turn.branch or None, tier="L2",
                              predicted_ttft_s=choice.predicted_ttft_s, policy=self.prestage_policy)

    def extra_snapshot(self) -> bytes:
        inner = super().extra_snapshot()  # type: ignore[misc]
        return _ENC.encode([inner, sorted(self.turns.items())])

    def restore_extra(self, data: bytes) -> None:
        if not data:
            return
        inner, turns = msgspec.msgpack.decode(data, type=tuple[bytes, list[tuple[str, _Turn]]])
        super().restore_extra(inner)  # type: ignore[misc]
        self.turns = dict(turns)


class PrestageLeastTtftRouter(PrestageMixin, LeastTtftRouter):
    """Evolving Infra's least-TTFT router with prestaging."""


class PrestageCacheAwareRouter(PrestageMixin, CacheAwareRouter):
    """SGLang-style cache-aware routing with prestaging."""


class PrestageDynamoKvRouter(PrestageMixin, DynamoKvRouter):
    """Dynamo's KV router cost with prestaging."""


class PrestageLeastLoadedRouter(PrestageMixin, LeastLoadedRouter):
    """Least-loaded routing with prestaging."""



#: router class -> its prestaging variant: the routers whose choice has no side effect (sticky
#: and round robin advance state when they choose)
VARIANTS: dict[type, type] = {LeastTtftRouter: PrestageLeastTtftRouter, CacheAwareRouter: PrestageCacheAwareRouter,
                              DynamoKvRouter: PrestageDynamoKvRouter, LeastLoadedRouter: PrestageLeastLoadedRouter}


def with_prestage(cls: type) -> type:
    """``cls``'s prestaging variant (the ``+prestage`` part of a router's plug-in name); a
    ``KeyError`` naming the routers that have one when ``cls`` has none."""
    if cls in VARIANTS.values():
        return cls
    if cls not in VARIANTS:
        raise KeyError(f"router {cls.__name__} has no prestaging variant (its choice advances its state); "
                       f"routers with one: {', '.join(sorted(c.__name__ for c in VARIANTS))}")
    return VARIANTS[cls]
