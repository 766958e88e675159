"""The worker's side of cancellation (docs/gateway.md, "Cancellation"): a
``RequestCancelled`` folded from the stream (after the start head) stops the request wherever it
is on this node. Every node folds the cancel; only the one holding the request reports it.

- Held here (its ids on their way from the prompt store, queued, prefilling, waiting for its
  KV, decoding): dropped, or stopped by ``backend.cancel`` within an iteration, and reported
  ``RequestFinished(error="cancelled")`` by this node.
- Routed here after the cancel (the router does not act on cancels, so a replay of its decisions
  stays what it was): finished at once, never enqueued.
- Not held now but it may still come (its KV in flight to this node, a peer's first token not yet
  folded): ``backend.cancel`` is tried again every ``CANCEL_RETRY_S`` of wall time until it takes
  the request, the stream says the request finished (any node's ``RequestFinished``), or
  ``CANCEL_GIVE_UP_S`` passed.
"""

from __future__ import annotations

from events.catalog import RequestCancelled, RequestFinished, RouteDecided
from services.adapters.logging import get_logger

log = get_logger("worker")


class Cancelling:
    """``EngineWorker``'s cancellation (engine/worker/loop.py holds ``_cancelled``: request ->
    tries so far, for the requests cancelled that this node may still get)."""

    CANCEL_RETRY_S = 0.2
    CANCEL_GIVE_UP_S = 300.0

    def _on_cancel(self, e: RequestCancelled) -> None:
        rid = e.request
        if rid not in self.view.requests or rid in self._cancelled:
            return  # finished already (or never seen here), or being cancelled
        self.host.catch_up()
        if self._cancel_here(rid):
            log.info("request_cancelled", node=self.node_id, request=rid, reason=e.reason)
            return
        self._cancelled[rid] = 0
        self._retry_later(rid)

    def _cancel_here(self, rid: str) -> bool:
        """Stop ``rid`` if this node holds it; False when it does not."""
        if self.prompt_fetch.cancel_pending(rid):
            self._queued_here.discard(rid)
            self._finish_cancelled(rid)
            return True
        if self.backend.cancel(rid):
            self._queued_here.discard(rid)
            return True
        return False

    def _finish_cancelled(self, rid: str) -> None:
        self.host.emit(RequestFinished(ts=self.host.catch_up(), src=self.src, request=rid, node=self.node_id,
                                       error="cancelled"))

    def _routed_cancelled(self, e: RouteDecided) -> bool:
        """A route to prefill here of a request already cancelled: finish it instead (True)."""
        rid = e.request
        if rid not in self._cancelled or e.prefill_node != self.node_id or rid in self._queued_here:
            return False
        del self._cancelled[rid]
        log.info("request_cancelled", node=self.node_id, request=rid, reason="routed after its cancel")
        self._finish_cancelled(rid)
        return True

    def _retry_later(self, rid: str) -> None:
        self.host.schedule(self.host.now + self.CANCEL_RETRY_S * self.host.scale, self._retry_cancel, rid)

    def _retry_cancel(self, rid: str) -> None:
        tries = self._cancelled.get(rid)
        if tries is None or rid not in self.view.requests:
            self._cancelled.pop(rid, None)  # it finished (here or elsewhere)
            return
        if self._cancel_here(rid):
            del self._cancelled[rid]
            log.info("request_cancelled", node=self.node_id, request=rid, reason="arrived after its cancel")
            return
        if (tries + 1) * self.CANCEL_RETRY_S >= self.CANCEL_GIVE_UP_S:
            del self._cancelled[rid]
            log.warning("cancel_given_up", node=self.node_id, request=rid, after_s=self.CANCEL_GIVE_UP_S,
                        why="it never reached this node and no RequestFinished came")
            return
        self._cancelled[rid] = tries + 1
        self._retry_later(rid)
