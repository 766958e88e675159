"""The worker's way out to the bus: the publisher task that drains the queue of the node's events
and token messages in order, each event under a message id of its own and retried while the bus
cannot take it, and the heartbeats, published straight to the bus beside that queue
(engine/worker/__init__.py, 4-6)."""

from __future__ import annotations

import asyncio
import time

from nats.errors import Error as NatsError
from nats.js.errors import APIError, ServiceUnavailableError

from events.catalog import Event, NodeHeartbeat
from events.wire import TokenMsg
from services.adapters.logging import get_logger

log = get_logger("worker")


def _retryable(exc: BaseException) -> bool:
    """A publication error that may pass on a retry: the bus unreachable or JetStream not
    answering (yet). A JetStream API error other than 503 (a refused message) will not."""
    if isinstance(exc, ServiceUnavailableError):
        return True
    if isinstance(exc, APIError):
        return False
    return isinstance(exc, NatsError | TimeoutError | OSError | ConnectionError)


class Publishing:
    """``EngineWorker``'s publications (engine/worker/loop.py holds the state: ``bus``, ``tokens``,
    ``_out``, ``_unechoed``, ``published``, ``publish_retries``, ``_boot``, ``_msg_seq``)."""

    async def _publisher(self) -> None:
        while True:
            item = await self._out.get()
            try:
                if isinstance(item, TokenMsg):
                    await self.tokens.publish(item)  # core NATS: buffered by the client while it reconnects
                else:
                    await self._publish_event(item)
            except Exception as exc:  # noqa: BLE001 - a lost publication is logged, the node goes on
                if not isinstance(item, TokenMsg):
                    self._unechoed = max(0, self._unechoed - 1)  # its echo will never come
                log.error("publish_failed", node=self.node_id, item=type(item).__name__,
                          error=str(exc) or type(exc).__name__)
            finally:
                self._out.task_done()

    async def _publish_event(self, event: Event) -> None:
        """Publish ``event`` with a message id of its own (``node:run:n``) and, while the bus
        cannot take it (server down, a cluster electing a leader), try again with the same id,
        in order (the queue waits): the stream's duplicate window drops a retry whose first try
        was stored after all. Retries stop inside that window (beyond it a retry could store
        the event twice); an error that a retry cannot fix (a refused event) is raised at once."""
        self._msg_seq += 1
        msg_id = f"{self.src}:{self._boot}:{self._msg_seq}"
        settings = getattr(self.bus, "settings", None)
        window = getattr(settings, "duplicate_window_s", 120.0) or 120.0
        deadline = time.monotonic() + 0.8 * window
        delay, failures = 0.05, 0
        while True:
            try:
                await self.bus.publish(event, msg_id=msg_id)
            except Exception as exc:
                if not _retryable(exc) or time.monotonic() + delay > deadline:
                    raise
                failures += 1
                if failures == 1:
                    self.publish_retries += 1
                if failures == 1 or failures % 20 == 0:
                    log.warning("publish_retrying", node=self.node_id, item=type(event).__name__, msg_id=msg_id,
                                attempt=failures, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            self.published += 1
            if failures:
                log.info("publish_recovered", node=self.node_id, item=type(event).__name__, msg_id=msg_id,
                         attempts=failures + 1)
            return

    async def _heartbeats(self) -> None:
        """``NodeHeartbeat`` every ``heartbeat_s`` of wall clock, published straight to the bus
        (not queued behind the node's events: a burst of them, a drain or a retrying publication
        must not delay it past the liveness timeout). A heartbeat changes no core's state a
        restart depends on, so it is neither applied to the view nor waited for (its echo is
        skipped), and a failed one is only logged: the next one follows."""
        beats = 0
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                beat = self.heartbeat()
                self.metrics.observe(beat)
                msg_id = f"{self.src}:{self._boot}:hb{beats}"  # ids of their own: not in the events' order
                await asyncio.wait_for(self.bus.publish(beat, msg_id=msg_id), max(2.0, 2 * self.heartbeat_s))
                self.published += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a lost heartbeat: the next one follows
                log.warning("heartbeat_failed", node=self.node_id, error=f"{type(exc).__name__}: {exc}")
            beats += 1
            if self.kv is not None and beats % 10 == 0:
                log.info("kv_bytes", node=self.node_id, **self.kv.summary())

    def heartbeat(self) -> NodeHeartbeat:
        ld = self.backend.load()
        return NodeHeartbeat(ts=self.host.catch_up(), src=self.src, node=self.node_id, role=ld.role,
                             running=ld.running, queued=ld.queued,
                             l1_used_tokens=ld.l1_used_tokens, l2_used_tokens=ld.l2_used_tokens)
