"""The generic live adapter: a durable JetStream consumer folded through a pure core.

One :class:`ServiceRunner` per service process (directory, planner, router, a shadow router).
What it does, in order, for every batch of deliveries:

1. **Fold.** Each delivery goes through :class:`services.cores.contract.Sequenced` (a sequence at or
   below the applied one is a redelivery and changes nothing). A core that raises is not
   fatal: the message is copied to the dead-letter subject ``eidlq.<p>.<service>`` with the
   exception, counted, and skipped (rule 7); the stream position moves on.
2. **Publish.** What the core emits and ``publish`` accepts is published in emission order,
   pipelined, each with the deterministic message id ``f"{service}:{seq}:{i}"`` (``seq`` the
   input's stream sequence, ``i`` the index in the core's output) so JetStream drops a
   re-publication inside its duplicate window. A router in shadow publishes under
   ``ei.<p>.shadow.<name>.>``. An empty ``src`` is stamped with the service name.
   Every confirmed decision must come back on the runner's own consumer (it reads the whole
   partition): one whose acknowledged sequence the consumer passes without its echo (a retry
   answered "duplicate" for a message a new stream leader never stored) is published again
   under ``<id>~<n>``; either id's echo confirms it.
3. **Ack** the batch's last sequence once every publication of the batch is confirmed.
4. **Snapshot** every ``snapshot_every`` events or ``snapshot_interval_s`` seconds, and on a
   clean stop: ``put_snapshot(service, ...)`` with the core's state, the sequence it covers and
   a fingerprint of the core's configuration. A snapshot is only written when every decision
   of the sequences it covers is confirmed on the stream.

Restart. The consumer starts at ``snapshot seq + 1`` (or 1 without a usable snapshot: none, or
one whose fingerprint differs from the configuration now asked for), whatever its ack floor
says: the snapshot, not the ack, is the truth about what the state holds. The tail up to the
stream head seen at start (``recover_until``) is replayed with its outputs **held**: every
delivery in the tail whose ``Nats-Msg-Id`` is a held id proves that decision was already
published before the crash, and drops it. When the replay reaches ``recover_until`` (or the
consumer goes idle for ``recover_idle_s``), what is still held - decisions lost between the
core's emission and their publication - is published, in order. So no decision is lost and
none is published twice, even after the duplicate window has passed; the message ids are a
second guard.

Time. The runner reads the clock only to pace snapshots and to measure lag; every decision is
made by the core from the events' ``ts``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from events import codec
from events.authority import Refused
from events.catalog import AnomalyReported, Event
from services.adapters.aio import wait_for
from services.adapters.bus.port import (
    MSG_ID,
    Bus,
    Consumer,
    Delivery,
    dead_letter,
)
from services.adapters.logging import get_logger
from services.adapters.metrics import ServiceMetrics
from services.cores.contract import Sequenced

log = get_logger("runner")

#: Layout of a service snapshot; a snapshot of another layout is rebuilt, never guessed at.
SNAPSHOT_FORMAT = 2


class _RunnerSnap(msgspec.Struct, array_like=True):
    """A service snapshot that cannot lie: what it was made by (format, event schema, core,
    configuration fingerprint), the stream position it covers, and a checksum over all of it."""

    format: int
    schema: str  # events.codec.SCHEMA_VERSION of the events folded into it
    core: str  # the core's class (a snapshot of another core is not restored into this one)
    fingerprint: str  # the service configuration (a snapshot of another configuration is ignored)
    applied_seq: int  # stream position covered (must equal the one inside ``sequenced``)
    checksum: str  # blake2b-128 over every field above and ``sequenced``
    sequenced: bytes  # services.cores.contract.Sequenced snapshot: applied_seq + core bytes


class SnapshotRejected(Exception):
    """A snapshot that does not verify: the service rebuilds from sequence 0."""


def _snapshot_checksum(fmt: int, schema: str, core: str, fp: str, seq: int, body: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(msgspec.msgpack.encode([fmt, schema, core, fp, seq]))
    h.update(body)
    return h.hexdigest()


def seal_snapshot(core: str, fp: str, seqd: Sequenced) -> bytes:
    body = seqd.snapshot()
    seq = seqd.applied_seq
    return msgspec.msgpack.encode(_RunnerSnap(
        SNAPSHOT_FORMAT, codec.SCHEMA_VERSION, core, fp, seq,
        _snapshot_checksum(SNAPSHOT_FORMAT, codec.SCHEMA_VERSION, core, fp, seq, body), body))


def open_snapshot(data: bytes, core: str, fp: str, head: int, restorer) -> Sequenced:
    """The verified contents of a snapshot, or :class:`SnapshotRejected` saying why not."""
    try:
        snap = msgspec.msgpack.decode(data, type=_RunnerSnap)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotRejected(f"unreadable ({exc}); an older layout or a damaged object") from exc
    want = _snapshot_checksum(snap.format, snap.schema, snap.core, snap.fingerprint, snap.applied_seq,
                              snap.sequenced)
    if snap.checksum != want:
        raise SnapshotRejected("checksum mismatch: the snapshot was altered or damaged")
    if snap.format != SNAPSHOT_FORMAT:
        raise SnapshotRejected(f"snapshot format {snap.format}, this service writes {SNAPSHOT_FORMAT}")
    if snap.schema.split(".")[0] != codec.SCHEMA_VERSION.split(".")[0]:
        raise SnapshotRejected(f"event schema {snap.schema}, this service reads {codec.SCHEMA_VERSION}")
    if snap.core != core:
        raise SnapshotRejected(f"made by core {snap.core}, this service runs {core}")
    if snap.fingerprint != fp:
        raise SnapshotRejected("configuration changed")
    if snap.applied_seq > head:
        raise SnapshotRejected(f"covers sequence {snap.applied_seq} but the stream ends at {head}")
    seqd = Sequenced.restore(snap.sequenced, restorer)
    if seqd.applied_seq != snap.applied_seq:
        raise SnapshotRejected(f"inner position {seqd.applied_seq} != sealed position {snap.applied_seq}")
    return seqd


def fingerprint(config: Mapping[str, Any]) -> str:
    """Stable hash of a service's configuration (a snapshot of another config is ignored)."""
    return hashlib.sha256(msgspec.json.encode(config, order="sorted")).hexdigest()[:16]


@dataclass
class RunnerConfig:
    """How one service folds and publishes. ``name`` is the durable consumer, the snapshot
    key and the message-id prefix; it must be unique per partition."""

    name: str
    config: Mapping[str, Any]  # the core's configuration (fingerprinted into the snapshot)
    publish: Callable[[Event], bool] | None = None  # which emitted events go out (None: all)
    shadow: str | None = None  # publish under ei.<p>.shadow.<shadow>.>
    subjects: str | None = None  # consumer filter (None: the whole partition)
    snapshot_every: int = 5000  # events folded between snapshots
    # ... or seconds, whichever comes first. A snapshot of the directory / router of a live stack
    # is megabytes (the block table), built, checksummed and uploaded into the object store: at
    # 5 s it was about a third of those services' CPU and load on nats-server while serving
    # (docs/experiments.md, "Against the real Dynamo"). A restart replays at most
    # ``snapshot_every`` events or this long of the stream; Dynamo's KV router snapshots only by
    # count (``--router-snapshot-threshold``, a million events).
    snapshot_interval_s: float = 60.0
    max_batch: int = 512
    recover_idle_s: float = 1.0
    lag_interval_s: float = 1.0


class ServiceRunner:
    """Durable consumer -> :class:`Sequenced` core -> published decisions (module docstring)."""

    def __init__(self, bus: Bus, cfg: RunnerConfig, make_core: Callable[[], Any],
                 restore_core: Callable[[bytes], Any], metrics: ServiceMetrics | None = None) -> None:
        self.bus, self.cfg = bus, cfg
        self.make_core, self.restore_core = make_core, restore_core
        self.metrics = metrics or ServiceMetrics(cfg.name)
        self.fp = fingerprint(cfg.config)
        self._core_cls: str | None = None
        self.seqd: Sequenced | None = None
        self.restored_from = 0  # snapshot position the service started from (0: rebuilt)
        self.recover_until = 0
        self.recovering = False
        self.head = 0
        self.published = 0
        self.last_decision: Event | None = None
        self.ready = asyncio.Event()  # set once the backlog seen at start is folded
        self._held: dict[str, Event] = {}
        self._since_snap = 0
        self._snap_at = 0.0
        #: Called with the running count after each confirmed publish (before the ack and the
        #: snapshot); fault injection (services/drivers/chaos/faults.py) and tests hook in here.
        self.after_publish: Callable[[int], None] | None = None
        self._bus_dead_letters = 0
        #: own decisions acknowledged by the bus whose echo has not come back on the consumer yet
        #: (message id -> (acknowledged sequence, event)); own message ids seen recently
        self._unechoed: dict[str, tuple[int, Event]] = {}
        self._own_seen: deque[str] = deque(maxlen=8192)
        self._own_seen_set: set[str] = set()
        self._seen_to = 0  # last stream sequence the consumer delivered
        self._republish_n = 0
        self._upload: asyncio.Task | None = None
        self._running = True
        m, name = self.metrics, cfg.name
        self._m_folded, self._m_redelivered = m.folded.labels(name), m.redelivered.labels(name)
        self._m_applied, self._m_lag = m.applied.labels(name), m.lag.labels(name)

    # ------------------------------------------------------------------ state
    @property
    def core(self):
        return self.seqd.core if self.seqd else None

    def _core_name(self) -> str:
        if self._core_cls is None:
            core = self.seqd.core if self.seqd is not None else self.make_core()
            self._core_cls = f"{type(core).__module__}.{type(core).__qualname__}"
        return self._core_cls

    @property
    def applied_seq(self) -> int:
        return self.seqd.applied_seq if self.seqd else 0

    def health(self) -> dict[str, Any]:
        return {"service": self.cfg.name, "ready": self.ready.is_set(), "applied_seq": self.applied_seq,
                "head": self.head, "lag": max(0, self.head - self.applied_seq),
                "restored_from": self.restored_from, "recovering": self.recovering,
                "published": self.published}

    async def load(self) -> None:
        """Restore from the service's snapshot when it matches the configuration, else start
        fresh at sequence 0."""
        # Every await comes before the core is replaced: a reader between two awaits (a health
        # probe, a test) sees the old core or the new one, never none.
        data = await self.bus.get_snapshot(self.cfg.name)
        self.head = await self.bus.last_seq()
        seqd: Sequenced | None = None
        if data is not None:
            try:
                seqd = open_snapshot(data, self._core_name(), self.fp, self.head,
                                     _Restorer(self.restore_core))
            except SnapshotRejected as exc:
                log.warning("snapshot_rejected", service=self.cfg.name, reason=str(exc),
                            action="rebuilding from sequence 0")
            except Exception as exc:  # noqa: BLE001 - a verified snapshot the core cannot read: rebuild
                log.error("snapshot_unreadable", service=self.cfg.name, error=f"{type(exc).__name__}: {exc}",
                          action="rebuilding from sequence 0")
        self.seqd = seqd if seqd is not None else Sequenced(self.make_core(), 0)
        self.restored_from = self.seqd.applied_seq
        self.recover_until = self.head
        self.recovering = self.recover_until > self.applied_seq
        log.info("service_start", service=self.cfg.name, from_snapshot=self.restored_from,
                 replay_to=self.recover_until)

    # ------------------------------------------------------------------ main loop
    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Fold until ``stop`` is set (then publish, ack and snapshot what is folded)."""
        stop = stop or asyncio.Event()
        if self.seqd is None:
            await self.load()
        if not self.recovering:
            self.ready.set()
            log.info("service_caught_up", service=self.cfg.name, applied_seq=self.applied_seq, republished=0,
                     skipped=0)
        buf: deque[Delivery] = deque()
        wake, room = asyncio.Event(), asyncio.Event()
        room.set()
        limit, max_batch = 4 * self.cfg.max_batch, self.cfg.max_batch
        start = self.applied_seq + 1
        async with self.bus.consumer(self.cfg.name, start_seq=start, subjects=self.cfg.subjects) as consumer:

            async def pump() -> None:
                async for d in consumer:
                    buf.append(d)
                    wake.set()
                    if len(buf) >= limit:  # back-pressure: the consumer's own buffer holds the rest
                        room.clear()
                        await room.wait()

            pump_task = asyncio.create_task(pump(), name=f"{self.cfg.name}-pump")
            stop_task = asyncio.create_task(stop.wait(), name=f"{self.cfg.name}-stop")
            lag_task = asyncio.create_task(self._watch_lag(), name=f"{self.cfg.name}-lag")
            # A stop or a consumer failure wakes the loop like a delivery does: the idle wait is
            # one Event, not a task and an asyncio.wait per wake-up (a fifth of the router's CPU).
            stop_task.add_done_callback(lambda _: wake.set())
            pump_task.add_done_callback(lambda _: wake.set())
            self._snap_at = time.monotonic()
            try:
                while not stop.is_set():
                    if not buf:
                        if pump_task.done():
                            pump_task.result()  # re-raise a consumer failure
                            break
                        wake.clear()
                        idle = False
                        if self.recovering:
                            try:
                                await wait_for(wake.wait(), self.cfg.recover_idle_s)
                            except TimeoutError:
                                idle = True
                        else:
                            await wake.wait()
                        if not buf:
                            if idle:  # idle while replaying the tail: the tail is done
                                await self._process([], consumer, end_recovery=True)
                            continue
                    batch = [buf.popleft() for _ in range(min(len(buf), max_batch))]
                    room.set()
                    await self._process(batch, consumer)
                    await self._maybe_snapshot()
            finally:
                self._running = False
                await cancel_all((pump_task, stop_task, lag_task))
            if stop.is_set():
                while buf:
                    await self._process([buf.popleft() for _ in range(min(len(buf), max_batch))], consumer)
                if self.recovering:
                    await self._process([], consumer, end_recovery=True)
                await consumer.flush()
                await self.snapshot()
        log.info("service_stopped", service=self.cfg.name, applied_seq=self.applied_seq,
                 published=self.published)

    async def _process(self, batch: list[Delivery], consumer: Consumer, end_recovery: bool = False) -> None:
        """One batch: fold it, publish what it decided, acknowledge it, count it."""
        out, folded = await self._fold_batch(batch)
        if self.recovering and end_recovery:
            out = self._end_recovery() + out
        lost = self._passed_unechoed()
        if lost:
            await self._publish(self._republish_ids(lost), count=False)
        if out:
            await self._publish(out)
        if batch:
            self.head = max(self.head, batch[-1].seq)
            if not self.recovering:
                await consumer.ack(batch[-1].seq)
        self._count(batch, folded)

    async def _fold_batch(self, batch: list[Delivery]) -> tuple[list[tuple[str, Event]], int]:
        """Fold each delivery once; return the decisions to publish now (with their message ids)
        and how many deliveries were folded. While recovering, decisions are held instead."""
        out: list[tuple[str, Event]] = []
        folded = 0
        seqd = self.seqd
        for d in batch:
            self._note_echo(d)
            if self.recovering and self._held:
                self._release_republished(d)
            if d.seq <= seqd.applied_seq:
                seqd.skipped += 1
                self._m_redelivered.inc()
                continue
            # the fold itself is synchronous: no coroutine per event unless the core raises
            try:
                emitted = seqd.fold(d.seq, d.event, d.subject)
            except Refused as exc:  # the authority rule (events/authority.py): never folded
                self.metrics.refused.labels(self.cfg.name).inc()
                await self._dead_letter(d, f"refused: {exc.reason}")
                emitted = []
            except Exception as exc:  # noqa: BLE001 - a core bug must not stop the service
                emitted = await self._core_failed(d, exc)
            folded += 1
            if emitted:
                for mid, ev in self._outgoing(d.seq, emitted):
                    if self.recovering:
                        self._held[mid] = ev
                    else:
                        out.append((mid, ev))
            if self.recovering and d.seq >= self.recover_until:
                out = self._end_recovery() + out
        return out, folded

    def _release_republished(self, d: Delivery) -> None:
        """A decision held during recovery that is already on the stream (its message id comes
        back) is not published again."""
        mid = d.headers.get(MSG_ID) if d.headers else None
        if mid is not None and self._held.pop(base_msg_id(mid), None) is not None:
            self.metrics.republish_skipped.labels(self.cfg.name).inc()

    def _note_echo(self, d: Delivery) -> None:
        """Remember the consumer's position and the echo of an own decision."""
        self._seen_to = max(self._seen_to, d.seq)
        mid = d.headers.get(MSG_ID) if d.headers else None
        if mid is None or not mid.startswith(self.cfg.name + ":"):
            return
        mid = base_msg_id(mid)
        self._unechoed.pop(mid, None)
        if mid not in self._own_seen_set:
            if len(self._own_seen) == self._own_seen.maxlen:
                self._own_seen_set.discard(self._own_seen[0])
            self._own_seen.append(mid)
            self._own_seen_set.add(mid)

    def _track_echoes(self, items: list[tuple[str, Event]], seqs: list[int]) -> list[tuple[str, Event]]:
        """After a publish: what the bus acknowledged must come back on the consumer. An ack at
        a sequence the consumer already passed without this id (a retry after a killed stream
        leader can be answered "duplicate" for a message the new leader never stored) is a
        lost decision: returned, to publish again. The others wait for their echo."""
        if self.cfg.subjects is not None or len(seqs) != len(items):
            return []  # a filtered consumer does not see every sequence: nothing to compare
        lost = []
        for (mid, ev), seq in zip(items, seqs, strict=True):
            base = base_msg_id(mid)
            if base in self._own_seen_set:
                continue
            if seq > self._seen_to:
                self._unechoed[base] = (seq, ev)
            else:
                lost.append((base, ev))
        return lost

    def _passed_unechoed(self) -> list[tuple[str, Event]]:
        """Own decisions whose acknowledged sequence the consumer passed without their echo."""
        if not self._unechoed:
            return []
        gone = [(mid, ev) for mid, (seq, ev) in self._unechoed.items() if seq <= self._seen_to]
        for mid, _ev in gone:
            del self._unechoed[mid]
        return gone

    async def _core_failed(self, d: Delivery, exc: Exception) -> list[Event]:
        """The core raised on ``d``: dead-letter it and move past it (rule 7)."""
        self.seqd.applied_seq = d.seq
        await self._dead_letter(d, f"core {type(exc).__name__}: {exc}")
        return []

    def _outgoing(self, seq: int, emitted: list[Event]) -> list[tuple[str, Event]]:
        """The emitted events this service publishes, stamped with its name as ``src`` and a
        message id derived from the input's sequence (so a re-fold publishes the same ids)."""
        name, keep = self.cfg.name, self.cfg.publish
        out = []
        for i, ev in enumerate(emitted):
            if keep is not None and not keep(ev):
                continue
            if not ev.src:
                ev = msgspec.structs.replace(ev, src=name)
            out.append((f"{name}:{seq}:{i}", ev))
        return out

    def _count(self, batch: list[Delivery], folded: int) -> None:
        bus_dl = getattr(self.bus, "dead_lettered", 0)  # undecodable messages the bus skipped
        if bus_dl > self._bus_dead_letters:
            self.metrics.dead_letters.labels(self.cfg.name).inc(bus_dl - self._bus_dead_letters)
            self._bus_dead_letters = bus_dl
        self._m_folded.inc(folded)
        self._m_applied.set(self.applied_seq)
        self._m_lag.set(max(0, self.head - self.applied_seq))
        self._since_snap += len(batch)

    def _end_recovery(self) -> list[tuple[str, Event]]:
        held, self._held = list(self._held.items()), {}
        self.recovering = False
        self.ready.set()
        log.info("service_caught_up", service=self.cfg.name, applied_seq=self.applied_seq,
                 republished=len(held), skipped=int(self.metrics.value("ei_service_republish_skipped_total")))
        return held

    def _republish_ids(self, lost: list[tuple[str, Event]]) -> list[tuple[str, Event]]:
        """Lost decisions under a fresh id (``<id>~<n>``: the bus remembers the old one as
        stored); the echo of either id confirms the decision."""
        out = []
        for mid, ev in lost:
            self._republish_n += 1
            out.append((f"{mid}~{self._republish_n}", ev))
        log.warning("decisions_lost_republished", service=self.cfg.name, n=len(out),
                    ids=[m for m, _ in out[:5]])
        return out

    async def _publish(self, items: list[tuple[str, Event]], count: bool = True) -> None:
        seqs = await publish_with_ids(self.bus, items, self.cfg.shadow)
        sent = items
        for _ in range(3):  # a re-publication can be lost the same way: bounded
            lost = self._track_echoes(sent, seqs)
            if not lost:
                break
            sent = self._republish_ids(lost)
            seqs = await publish_with_ids(self.bus, sent, self.cfg.shadow)
        if not count:
            return
        m, name = self.metrics, self.cfg.name
        for _mid, ev in items:
            if isinstance(ev, AnomalyReported):
                m.anomalies.labels(name, ev.kind).inc()
            else:
                m.decisions.labels(name, type(ev).__name__).inc()
                self.last_decision = ev
        self.published += len(items)
        if self.after_publish is not None:
            self.after_publish(self.published)

    async def _dead_letter(self, d: Delivery, reason: str) -> None:
        """Copy ``d`` to this account's dead-letter subject. A dead letter the bus does not take
        (a permissions violation, a timeout) is logged whole and counted; it never stops the fold."""
        self.metrics.dead_letters.labels(self.cfg.name).inc()
        log.error("dead_letter", consumer=self.cfg.name, seq=d.seq, subject=d.subject, reason=reason)
        ok = await dead_letter(self.bus, self.cfg.name, d.seq, d.subject, codec.encode(d.event), reason)
        if not ok:
            self.metrics.dead_letter_failed.labels(self.cfg.name).inc()

    # ------------------------------------------------------------------ snapshots and lag
    async def _maybe_snapshot(self) -> None:
        due = self._since_snap >= self.cfg.snapshot_every or (
            self._since_snap and time.monotonic() - self._snap_at >= self.cfg.snapshot_interval_s)
        if due and not self.recovering:
            await self.snapshot(wait=False)

    async def snapshot(self, wait: bool = True) -> None:
        """Take the snapshot now (never while decisions of folded sequences are held) and
        upload it; ``wait=False`` uploads in the background so the fold goes on (one upload at
        a time, so an older snapshot never lands after a newer one)."""
        if self.recovering or self.seqd is None:
            return
        if self._upload is not None and not self._upload.done():
            if not wait:
                return  # still uploading the previous one: try again after the next batch
            await self._upload
        data = seal_snapshot(self._core_name(), self.fp, self.seqd)
        self._since_snap = 0
        self._snap_at = time.monotonic()
        self._upload = asyncio.create_task(self._put(data), name=f"{self.cfg.name}-snapshot")
        if wait:
            await self._upload

    async def _put(self, data: bytes) -> None:
        try:
            await self.bus.put_snapshot(self.cfg.name, data)
        except Exception as exc:  # noqa: BLE001 - a lost snapshot only lengthens the next replay
            log.error("snapshot_failed", service=self.cfg.name, error=str(exc))
            return
        self.metrics.snapshots.labels(self.cfg.name).inc()

    async def _watch_lag(self) -> None:
        while self._running:
            try:
                self.head = await self.bus.last_seq()
                self.metrics.lag.labels(self.cfg.name).set(max(0, self.head - self.applied_seq))
            except Exception as exc:  # noqa: BLE001 - lag is best effort; the fold goes on
                log.warning("lag_unknown", service=self.cfg.name, error=str(exc))
            await asyncio.sleep(self.cfg.lag_interval_s)


async def cancel_all(tasks, grace_s: float = 2.0) -> None:
    """Cancel ``tasks`` and wait for them. nats-py swallows a ``CancelledError`` that lands
    inside some of its publish paths (the task then carries on), so cancel again once after a
    grace period, and then leave what still runs behind rather than hang the shutdown."""
    pending = set(tasks)
    for _ in range(2):
        for t in pending:
            t.cancel()
        _done, pending = await asyncio.wait(pending, timeout=grace_s)
        if not pending:
            return
    log.warning("tasks_left_running", tasks=sorted(t.get_name() for t in pending))


def base_msg_id(mid: str) -> str:
    """The decision's own message id without a re-publication suffix (``<id>~<n>``)."""
    return mid.split("~", 1)[0]


class _Restorer:
    """Adapts a ``bytes -> core`` function to ``Sequenced.restore``'s ``core_type`` argument."""

    def __init__(self, fn: Callable[[bytes], Any]) -> None:
        self.from_snapshot = fn


async def publish_with_ids(bus: Bus, items: list[tuple[str, Event]], shadow: str | None = None) -> list[int]:
    """Publish ``(msg_id, event)`` pairs in order (pipelined on JetStream). Returns the stream
    sequences (a duplicate id returns the original's)."""
    if not items:
        return []
    return await bus.publish_many([ev for _, ev in items], msg_ids=[mid for mid, _ in items], shadow=shadow)

