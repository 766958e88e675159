"""The worker's way in from the stream: fold each delivery into the worker's view, and from the
start head on act on it (a route enqueues or takes back a prefill job, a ``SwitchRole`` orders a
switch, a peer's ``FirstToken`` admits the decode, a removal of this node registers it again, a
``RequestCancelled`` stops the request: engine/worker/cancel.py, a ``KvStageOrdered`` naming this
node stages a finished turn's KV here); the view's snapshots
(engine/worker/__init__.py, 1-3 and 6)."""

from __future__ import annotations

import asyncio
import time

from engine.backend import DecodeJob, PrefillJob, request_output
from engine.worker.cancel import Cancelling
from events import codec
from events.catalog import (
    Event,
    FirstToken,
    KvStageOrdered,
    KvStored,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestCancelled,
    RequestFinished,
    RequestStarted,
    RouteDecided,
    SwitchRole,
)
from events.ids import NodeId
from services.adapters.bus.port import dead_letter
from services.adapters.logging import get_logger
from services.cores.contract import Sequenced
from services.cores.worker_view import WorkerView

log = get_logger("worker")
_DONE = "\x00first-token"  # _prefill_at: the prefill ended (a FirstToken), wherever it ran


class StreamFolding(Cancelling):
    """``EngineWorker``'s stream input (engine/worker/loop.py holds the state: ``view``, ``backend``,
    ``host``, ``_head``, ``applied_seq``, ``_unechoed``, ``_since_snap``, ``_decode_for``,
    ``_queued_here``, ``prompt_fetch``)."""

    # ------------------------------------------------------------------ stream input
    def fold(self, seq: int, event: Event) -> None:
        """One delivery from the stream (in order). Up to the start head: the view only."""
        own_echo = seq > self._head and getattr(event, "src", None) == self.src
        self._peers_of(seq, event)
        held = None
        if (type(event) is NodeRemoved and event.node == self.node_id and not own_echo and seq > self._head
                and self.live.is_set() and not self._stopping):
            held = {tier: self.directory.copies(self.node_id, tier) for tier in ("L1", "L2")}
        if own_echo:
            if type(event) is not NodeHeartbeat:  # heartbeats skip the view and the count (_heartbeats)
                self._unechoed = max(0, self._unechoed - 1)
        else:
            self.view.apply(event)
        if held is not None and self.node_id not in self.directory.nodes():
            self._rejoin(event, held)
        self.applied_seq = max(self.applied_seq, seq)
        self._since_snap += 1
        t = type(event)
        self._prefill_facts(event, t)
        if (t in (NodeRegistered, NodeRemoved) and event.node == self.node_id and not own_echo
                and not self.live.is_set()):
            # what a previous run left, or what the stream says of it before this run registers:
            # a removal for silence can land after the start head and before start() checks
            # (chaos --engines --quick under load: d0's watcher removal 6 events past the head)
            self._own_last = "registered" if t is NodeRegistered else (event.reason or "removed")
        if seq <= self._head:
            return
        if t is RouteDecided and not event.shadow:
            self._on_route(event)
        elif t is SwitchRole and event.node == self.node_id:
            self.host.catch_up()
            log.info("switch_ordered", node=self.node_id, to_role=event.to_role, mechanism=event.mechanism)
            self.backend.order_switch(event.to_role, event.mechanism)
        elif t is FirstToken and event.node != self.node_id and event.request in self._decode_for:
            self._admit_decode(event.request, event.node)
        elif t is RequestCancelled:
            self._on_cancel(event)
        elif t is KvStageOrdered and event.dst_node == self.node_id:
            self._on_stage(event)

    def _on_stage(self, order: KvStageOrdered) -> None:
        """A stage order naming this node (the router's ``+prestage``): the backend pulls the
        finished turn's KV into its host tier (engine/backends/torch/peers.py, stage orders) and
        reports ``KvMoved``. A backend that stages nothing says so in one line, per order."""
        stage = getattr(self.backend, "stage_in", None)
        if stage is None:
            log.warning("stage_order_skipped", node=self.node_id, request=order.request, src=order.src_node,
                        reason=f"the {self.backend.name} backend does not stage KV")
            return
        self.host.catch_up()
        stage(order)

    def _rejoin(self, removed: NodeRemoved, held: dict[str, dict[int, float]]) -> None:
        """The stream says this node is gone (removed for silence while it was only late): register
        again with the current role, and re-publish the KV it holds, which the directory dropped
        (``KvStored`` without request, grouped by last access, so eviction order survives)."""
        self.rejoins += 1
        log.warning("removed_rejoining", node=self.node_id, removed_by=removed.src, reason=removed.reason,
                    role=self.backend.role, l1_blocks=len(held["L1"]), l2_blocks=len(held["L2"]))
        self._publish_own(self.registration())
        for tier, copies in held.items():
            by_ts: dict[float, list[int]] = {}
            for block, last in copies.items():
                by_ts.setdefault(last, []).append(block)
            for last in sorted(by_ts):
                blocks = sorted(by_ts[last])
                for i in range(0, len(blocks), 4096):  # well under NATS's 1 MB message limit
                    self._publish_own(KvStored(ts=last, src=self.src, node=self.node_id, tier=tier,
                                               blocks=blocks[i:i + 4096]))

    def _peers_of(self, seq: int, event: Event) -> None:
        if self.kv is None:
            return
        # a NodeRemoved keeps the endpoint: liveness may remove a node that is only late (its
        # next heartbeat revives it without a new registration); a dead peer fails the transfer
        if type(event) is NodeRegistered:
            self.kv.peer_registered(event.node, event.transfer_endpoint)

    def _prefill_facts(self, event: Event, t: type) -> None:
        """Where each request's prefill started and whether it ended (``FirstToken``), from the
        stream: a re-route the router decided before it saw the prefill start elsewhere must not
        run it twice (a worker's events reach the stream seconds late on a loaded machine: the
        planner's switch of p0 re-routed six requests p0 had begun, p1 prefilled them again 30 s
        later and their decode node took its KV from p1, which had none, in `evolving chaos
        --engines`)."""
        if t is RequestStarted and event.phase == "prefill":
            self._prefill_at[event.request] = event.node
        elif t is FirstToken:
            self._prefill_at[event.request] = _DONE
            self._first_from.setdefault(event.request, event.node)
        elif t is RequestFinished:
            self._prefill_at.pop(event.request, None)
            self._first_from.pop(event.request, None)
            self._decoding_here.discard(event.request)
            # a request that ended before its first token (cancelled, failed) is awaited no more
            self._decode_for.pop(event.request, None)
            self._cancelled.pop(event.request, None)
        elif t is NodeRemoved:  # a prefill running on a removed node never ends: re-routes then count
            for rid in [r for r, n in self._prefill_at.items() if n == event.node]:
                del self._prefill_at[rid]

    def _runs_elsewhere(self, e: RouteDecided) -> bool:
        at = self._prefill_at.get(e.request)
        return e.reroute and at is not None and at != self.node_id and (
            at == _DONE or at in self.directory.nodes())

    def _on_route(self, e: RouteDecided) -> None:
        rid = e.request
        if self._routed_cancelled(e):
            return
        if e.decode_node == self.node_id and e.prefill_node != self.node_id:
            if self._prefill_at.get(rid) != _DONE:
                self._decode_for[rid] = e.prefill_node
            elif e.reroute and rid not in self._decoding_here and rid in self._first_from:
                # a decode-only re-route after the first token (its decode node was removed before
                # it took the request): no later FirstToken admits it (a second one admits
                # nothing, and the prefill node leaves a re-route of an ended prefill alone), so
                # it is admitted now, with the KV of the node that sent the first. Before, it
                # waited here for good (two requests in `evolving chaos --engines --quick`)
                self._decode_for[rid] = self._first_from[rid]
                self._admit_decode(rid, self._first_from[rid])
        else:
            self._decode_for.pop(rid, None)
        if rid in self._queued_here and e.prefill_node != self.node_id:
            self.host.catch_up()
            if self.prompt_fetch.remove_queued(rid) is not None:
                self._queued_here.discard(rid)
            return
        if e.prefill_node != self.node_id:
            return
        if rid not in self._queued_here and self._runs_elsewhere(e):
            log.info("reroute_ignored", node=self.node_id, request=rid,
                     reason="its prefill started on a live node (or ended) before this re-route reached the stream",
                     prefill_at=self._prefill_at[rid])
            return
        req = self.view.requests.get(rid)
        if req is None:
            log.warning("route_without_request", request=rid)
            return
        now = self.host.catch_up()
        old = self.prompt_fetch.remove_queued(rid) if rid in self._queued_here else None
        if old is None and rid in self._queued_here:
            return  # its prefill runs here already: a decode-only re-route (the decode worker follows it)
        job = old or PrefillJob(request=rid, blocks=req.blocks, prompt_tokens=req.prompt_tokens,
                                max_tokens=req.max_tokens, decode_node=e.decode_node,
                                fetch_plan=e.fetch_plan, enqueued_s=now, priority=req.queue_priority(),
                                **request_output(req))
        if old is not None:
            job.decode_node, job.fetch_plan, job.fetched, job.fetch_s = e.decode_node, e.fetch_plan, [], 0.0
        self._queued_here.add(rid)
        self.prompt_fetch.enqueue(job)  # with its token ids from the prompt store, if any (prompts.py)

    def _admit_decode(self, rid: str, src: str) -> None:
        """The first ``FirstToken`` of a request to decode here admits it, with its KV from the
        node that sent that token (a re-route may have named another prefill node that never
        ran it); a later one (a prefill run twice) is ignored."""
        req = self.view.requests.get(rid)
        if req is None or self._decode_for.pop(rid, None) is None:
            return
        self._decoding_here.add(rid)
        now = self.host.catch_up()
        job = DecodeJob(request=rid, blocks=req.blocks, prompt_tokens=req.prompt_tokens,
                        left=float(max(0, req.max_tokens - 1)), total_out=max(1, req.max_tokens),
                        context=float(req.prompt_tokens + 1), src_node=NodeId(src), max_tokens=max(1, req.max_tokens),
                        **request_output(req))
        self.prompt_fetch.kv_arrived_at(now + self.profile.p2d_transfer_s(req.prompt_tokens), job, self.host.schedule)

    # ------------------------------------------------------------------ snapshots
    async def load_snapshot(self) -> None:
        """Restore the view from ``engine-<node>`` when there is a readable one, else start at 0."""
        data = await self.bus.get_snapshot(self.snapshot_key)
        if data is None:
            return
        try:
            seqd = Sequenced.restore(data, WorkerView)
        except Exception as exc:  # noqa: BLE001 - any unreadable snapshot: fold from sequence 1
            log.error("snapshot_unreadable", node=self.node_id, error=f"{type(exc).__name__}: {exc}",
                      action="folding from sequence 1")
            return
        self.view, self.applied_seq = seqd.core, seqd.applied_seq
        self.admission = seqd.admission
        self.restored_from = seqd.applied_seq

    async def snapshot(self) -> bool:
        """Write the view's snapshot if it is consistent (no own event awaiting its echo)."""
        if self._unechoed or self.applied_seq == 0:
            return False
        data = Sequenced(self.view, self.applied_seq, self.admission).snapshot()
        try:
            await self.bus.put_snapshot(self.snapshot_key, data)
        except Exception as exc:  # noqa: BLE001 - a lost snapshot only lengthens the next start
            log.error("snapshot_failed", node=self.node_id, error=str(exc))
            return False
        self._since_snap = 0
        return True

    async def _consume(self, caught_up: asyncio.Event) -> None:
        """The stream input, for the worker's whole life: a consumer that fails (the bus away, a
        consumer deleted) is opened again after the last sequence folded; bad input never stops
        it (:meth:`_take`)."""
        if self._head <= self.applied_seq:
            caught_up.set()
        watcher = asyncio.create_task(self._watch_head(), name="stream-head")
        try:
            while True:
                try:
                    async with self.bus.consumer(None, start_seq=self.applied_seq + 1) as c:
                        self.consumer_error = None
                        async for d in c:
                            if d.seq % 64 == 0:  # a buffered backlog folds without awaiting: let heartbeats run
                                await asyncio.sleep(0)
                            await self._take(d)
                            if d.seq >= self._head:
                                caught_up.set()
                            if self._since_snap >= self.snapshot_every and not self._unechoed:
                                await self.snapshot()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the input must come back, whatever stopped it
                    self.consumer_error = f"{type(exc).__name__}: {exc}"[:500]
                    log.error("stream_input_failed", node=self.node_id, applied_seq=self.applied_seq,
                              error=self.consumer_error, action="reopening after the last folded sequence in 1 s")
                    await asyncio.sleep(1.0)
        finally:
            watcher.cancel()

    async def _take(self, d) -> None:
        """One delivery: admitted by the event authority (events/authority.py), then folded; a
        refused one is dead-lettered to this engine's account and counted, a fold that raises is
        logged and counted. Either way the position moves past it."""
        why = self.admission.reason(d.event, d.subject)
        if why is not None:
            self.applied_seq = max(self.applied_seq, d.seq)
            self.metrics.refused.labels(self.node_id).inc()
            await self._dead_letter(d, f"refused: {why}")
        else:
            try:
                self.fold(d.seq, d.event)
            except Exception as exc:  # noqa: BLE001 - bad input never kills the node
                self.applied_seq = max(self.applied_seq, d.seq)
                self.metrics.fold_failed.labels(self.node_id).inc()
                log.error("fold_failed", node=self.node_id, seq=d.seq, event_type=type(d.event).__name__,
                          error=repr(exc))
        self._progress_at = time.monotonic()
        self.metrics.applied.labels(self.node_id).set(self.applied_seq)

    async def _dead_letter(self, d, reason: str) -> None:
        self.metrics.dead_letters.labels(self.node_id).inc()
        log.error("dead_letter", consumer=self.snapshot_key, seq=d.seq, subject=d.subject, reason=reason)
        if not await dead_letter(self.bus, self.snapshot_key, d.seq, d.subject, codec.encode(d.event), reason):
            self.metrics.dead_letter_failed.labels(self.node_id).inc()

    async def _watch_head(self, every_s: float = 1.0) -> None:
        """Poll the stream's head, so health can tell a view that keeps up from one that is stuck."""
        while True:
            try:
                head = await self.bus.last_seq()
                if head > self.stream_head and self.applied_seq >= self.stream_head:
                    self._progress_at = time.monotonic()  # it had caught up: the clock starts now
                self.stream_head = head
                self.metrics.lag.labels(self.node_id).set(max(0, head - self.applied_seq))
            except Exception as exc:  # noqa: BLE001 - best effort; the fold goes on
                log.debug("stream_head_unknown", node=self.node_id, error=str(exc))
            await asyncio.sleep(every_s)
