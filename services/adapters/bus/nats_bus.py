"""The bus on NATS JetStream: :class:`NatsBus`, one stream per partition, through nats-py.

Its twin is :class:`services.adapters.bus.memory.InMemoryBus`; both satisfy the port in
:mod:`services.adapters.bus.port` (delivery semantics there) and pass the same contract tests
(``tests/contract/test_bus.py``). Here: how the streams are created (:class:`StreamSettings`),
pipelined publishing with retries by message id, the snapshot object stores, the dead-letter
stream, and the pull consumer (:class:`_NatsConsumer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import BucketNotFoundError, NoStreamResponseError, NotFoundError, ObjectNotFoundError

from events import codec
from events.catalog import Event
from events.subjects import (
    DEFAULT_PARTITION,
    all_subjects,
    dlq_stream_name,
    dlq_subjects,
    stream_name,
    subject_for,
    token,
)
from services.adapters.aio import wait_for
from services.adapters.bus.port import (
    DLQ_CONSUMER,
    DLQ_REASON,
    DLQ_SEQ,
    DLQ_SUBJECT,
    MSG_ID,
    Connection,
    ConsumerState,
    DeadLetter,
    Delivery,
    Handler,
    Message,
    NoResponder,
    StreamInfo,
    dead_letter,
    decode_or_reason,
    handle,
)
from services.adapters.bus.security import Credentials, snapshot_bucket
from services.adapters.logging import get_logger

log = get_logger("bus")


@dataclass(frozen=True)
class StreamSettings:
    """How the partition's stream is created (file storage; replicas for a cluster)."""

    replicas: int = 1
    retention: str = "limits"  # limits | interest | workqueue
    max_age_s: float = 0.0  # 0 = keep forever
    max_bytes: int = -1
    duplicate_window_s: float = 120.0


class NatsBus:
    """JetStream-backed bus. Build it with :meth:`connect`."""

    def __init__(self, nc, js, partition: str, settings: StreamSettings) -> None:
        self.nc, self.js, self.partition, self.settings = nc, js, partition, settings
        self.stream = stream_name(partition)
        self.dlq_stream = dlq_stream_name(partition)
        self._obs: dict = {}
        self.dead_lettered = 0
        self.dead_letters_failed = 0
        #: the NATS user this bus is connected as: dead letters go to ``eidlq.<p>.<account>``, the
        #: one dead-letter subject its permissions allow (None on an open server: the consumer's name)
        self.account: str | None = None
        #: an ack not back within this long is a lost publish; with message ids it is retried for
        #: up to ``retry_for_s`` (a cluster electing a new stream leader), else it raises
        self.publish_timeout_s = 5.0
        self.retry_for_s = 60.0
        self.snapshot_timeout_s = 10.0  # one read of a snapshot (get_snapshot)
        self._owns_connection = True  # False for a for_partition() sibling: close() leaves nc open

    @classmethod
    async def connect(
        cls,
        url: str,
        partition: str = DEFAULT_PARTITION,
        *,
        user: str | None = None,
        password: str | None = None,
        token_: str | None = None,
        nkeys_seed: str | None = None,
        creds: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        name: str = "evolving",
        settings: StreamSettings | None = None,
        ensure: bool = True,
        credentials: Credentials | None = None,
    ) -> NatsBus:
        """Connect to ``url`` (a comma-separated list for a cluster: every server is tried and
        reconnected to) with ``credentials`` (services.adapters.bus.security) or the loose options."""
        servers = [u.strip() for u in url.split(",") if u.strip()]
        opts: dict = {"servers": servers, "name": name, "max_reconnect_attempts": -1}
        if credentials is not None:
            opts.update(credentials.connect_options())
        if user:
            opts.update(user=user, password=password)
        if token_:
            opts["token"] = token_
        if nkeys_seed:
            opts["nkeys_seed"] = nkeys_seed
        if creds:
            opts["user_credentials"] = creds
        if tls_ca or tls_cert:
            ctx = ssl.create_default_context(cafile=tls_ca)
            if tls_cert:
                ctx.load_cert_chain(tls_cert, tls_key)
            opts["tls"] = ctx
        _quiet_callbacks(opts, name)
        nc = await nats.connect(**opts)
        bus = cls(nc, nc.jetstream(), partition, settings or StreamSettings())
        account = user or (credentials.user if credentials is not None else None)
        bus.account = token(account) if account else None
        if ensure:
            await bus.ensure_streams()
        return bus

    async def ensure_streams(self) -> None:
        s = self.settings
        retention = {"limits": api.RetentionPolicy.LIMITS, "interest": api.RetentionPolicy.INTEREST,
                     "workqueue": api.RetentionPolicy.WORK_QUEUE}[s.retention]
        for name, subj in ((self.stream, all_subjects(self.partition)),
                           (self.dlq_stream, dlq_subjects(self.partition))):
            cfg = api.StreamConfig(
                name=name, subjects=[subj], storage=api.StorageType.FILE, num_replicas=s.replicas,
                retention=retention if name == self.stream else api.RetentionPolicy.LIMITS,
                max_age=s.max_age_s or None, max_bytes=s.max_bytes,
                duplicate_window=s.duplicate_window_s,
            )
            try:
                info = await self.js.stream_info(name)
            except NotFoundError:
                await self.js.add_stream(cfg)  # needs the admin's permission on a secured bus
                continue
            have = info.config
            if (have.num_replicas or 1) > cfg.num_replicas:
                # A client started with default settings (a service given only a URL) must not
                # scale an R3 stream down to R1: adopt the stream's replicas (snapshot buckets too).
                cfg.num_replicas = have.num_replicas
                if name == self.stream:
                    self.settings = dataclasses.replace(self.settings, replicas=have.num_replicas)
            if (have.num_replicas, have.max_age or None, have.max_bytes, have.duplicate_window) != (
                    cfg.num_replicas, cfg.max_age, cfg.max_bytes, cfg.duplicate_window):
                try:
                    await self.js.update_stream(cfg)
                except Exception as exc:  # noqa: BLE001 - a service account may not change the stream
                    log.warning("stream_settings_kept", stream=name, error=str(exc) or type(exc).__name__)

    async def publish(self, event: Event, *, msg_id: str | None = None, shadow: str | None = None) -> int:
        return await self.publish_raw(subject_for(event, self.partition, shadow), codec.encode(event),
                                      codec.headers(), msg_id=msg_id)

    async def publish_many(self, events: Sequence[Event], *, msg_ids: Sequence[str] | None = None,
                           shadow: str | None = None) -> list[int]:
        """Publish pipelined (no wait per message), then collect the acks in order. A duplicate
        ``msg_ids`` entry answers with the original's sequence."""
        futs = []
        base = codec.headers()
        try:
            for i, ev in enumerate(events):
                hdrs = base if msg_ids is None else {**base, MSG_ID: msg_ids[i]}
                futs.append(await self.js.publish_async(subject_for(ev, self.partition, shadow), codec.encode(ev),
                                                        headers=hdrs))
            # nats-py never times an async publish out: an ack lost with a server would hang here
            acks = await wait_for(asyncio.gather(*futs, return_exceptions=True), self.publish_timeout_s)
        except Exception as exc:
            for f in futs:
                f.cancel()
            if msg_ids is None:
                raise
            # With message ids a retry is safe (the duplicate window drops what did land): publish
            # one by one, in order, until the cluster answers (a leader election takes seconds).
            log.warning("publish_retry", events=len(events), error=f"{type(exc).__name__}: {exc}")
            return [await self._publish_retrying(ev, mid, shadow) for ev, mid in zip(events, msg_ids, strict=True)]
        return await self._finish_batch(events, acks, msg_ids, shadow)

    async def _finish_batch(self, events: Sequence[Event], acks: list, msg_ids: Sequence[str] | None,
                            shadow: str | None) -> list[int]:
        """The sequences of a pipelined batch whose acks all came back. A tail that no stream took
        (no responders: a leader election after a lost server, or a stream interest that has not
        reached this server yet) is published again one by one, in order, through
        :meth:`publish_raw`'s bounded retry: nothing of it landed, so the retry cannot duplicate,
        with or without message ids, and the order holds because nothing after it landed
        either. Any other failure is raised as it came."""
        first = next((i for i, a in enumerate(acks) if isinstance(a, BaseException)), None)
        if first is None:
            return [a.seq for a in acks]
        seqs = [a.seq for a in acks[:first]]
        tail = acks[first:]
        if msg_ids is not None:  # the duplicate window drops what did land: retry from the first failure
            log.warning("publish_retry", events=len(tail), error=f"{type(acks[first]).__name__}: {acks[first]}")
            return seqs + [await self._publish_retrying(events[i], msg_ids[i], shadow) for i in range(first, len(events))]
        if not all(isinstance(a, NoStreamResponseError) for a in tail):
            # something landed after a lost one (its order is broken) or another failure: say it
            raise next((a for a in tail if isinstance(a, BaseException) and not isinstance(a, NoStreamResponseError)),
                       acks[first])
        log.warning("publish_retry", events=len(tail), error="no response from stream")
        base = codec.headers()
        for ev in events[first:]:
            seqs.append(await self.publish_raw(subject_for(ev, self.partition, shadow), codec.encode(ev), base))
        return seqs

    async def _publish_retrying(self, ev: Event, msg_id: str, shadow: str | None) -> int:
        deadline = asyncio.get_running_loop().time() + self.retry_for_s
        while True:
            try:
                return await self.publish(ev, msg_id=msg_id, shadow=shadow)
            except Exception:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.25)

    async def publish_raw(self, subject: str, data: bytes, headers: Mapping[str, str] | None = None,
                          msg_id: str | None = None) -> int:
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs[MSG_ID] = msg_id
        deadline = asyncio.get_running_loop().time() + min(self.retry_for_s, 10.0)
        while True:
            try:
                ack = await self.js.publish(subject, data, headers=hdrs or None)
                return ack.seq
            except NoStreamResponseError:
                # No responder: no stream took the message (a cluster just formed, whose
                # stream interest has not reached this server yet, or a leader election), so a
                # retry cannot duplicate it, with or without a message id.
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def last_seq(self) -> int:
        info = await self.js.stream_info(self.stream)
        return info.state.last_seq

    async def stream_info(self) -> StreamInfo:
        info = await self.js.stream_info(self.stream)
        dlq = await self.js.stream_info(self.dlq_stream)
        cl = info.cluster
        current = 1 + sum(1 for r in (cl.replicas or []) if r.current) if cl else 1
        return StreamInfo(last_seq=info.state.last_seq, messages=info.state.messages,
                          replicas=info.config.num_replicas or 1, dead_letters=dlq.state.messages,
                          bytes=info.state.bytes, leader=(cl.leader or "") if cl else "", replicas_current=current)

    @property
    def url(self) -> str | None:
        u = self.nc.connected_url
        return f"{u.scheme}://{u.hostname}:{u.port}" if u else None

    async def consumer_ack_floor(self, durable: str) -> int | None:
        try:
            info = await self.js.consumer_info(self.stream, durable)
        except NotFoundError:
            return None
        return info.ack_floor.stream_seq if info.ack_floor else 0

    async def consumers(self) -> list[ConsumerState]:
        # $JS.API.CONSUMER.LIST.<stream>: read-only, allowed to the gateway's account (security.py)
        infos = await self.js.consumers_info(self.stream)
        return sorted((_consumer_state(i) for i in infos), key=lambda c: c.name)

    def connection(self) -> Connection:
        nc = self.nc
        u = nc.connected_url if nc.is_connected else None
        return Connection(connected=bool(nc.is_connected), reconnecting=bool(nc.is_reconnecting),
                          server=f"{u.hostname}:{u.port}" if u is not None else None)

    async def rewind_consumer(self, durable: str, start_seq: int) -> None:
        subjects = all_subjects(self.partition)
        try:
            info = await self.js.consumer_info(self.stream, durable)
        except NotFoundError:
            pass
        else:
            subjects = info.config.filter_subject or subjects
            await self.js.delete_consumer(self.stream, durable)
        await self.js.add_consumer(self.stream, config=_durable_config(durable, max(start_seq, 1), subjects))

    async def listen(self, subject: str, handler: Handler) -> _NatsListener:
        async def cb(msg) -> None:
            reply = await handle(handler, Message(msg.subject, msg.data, msg.headers or {}))
            if reply is not None and msg.reply:
                with contextlib.suppress(Exception):  # the requester may be gone
                    await msg.respond(reply)

        sub = await self.nc.subscribe(subject, cb=cb, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await self.nc.flush()  # the server knows the listener when this returns
        return _NatsListener(subject, sub)

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        try:
            msg = await self.nc.request(subject, data, timeout=timeout_s)
        except NoRespondersError as exc:
            raise NoResponder(subject) from exc
        except NatsTimeoutError as exc:
            raise TimeoutError(f"no reply on {subject} within {timeout_s:g} s") from exc
        return msg.data

    def for_partition(self, partition: str) -> NatsBus:
        if partition == self.partition:
            return self
        other = NatsBus(self.nc, self.js, partition, self.settings)
        other.account = self.account
        other._owns_connection = False
        return other

    def consumer(self, durable: str | None, *, start_seq: int | None = None,
                 subjects: str | None = None, batch_acks: int = 256) -> _NatsConsumer:
        return _NatsConsumer(self, durable, start_seq, subjects or all_subjects(self.partition), batch_acks)

    async def _objects(self, name: str, create: bool):
        """The object store of one service's snapshots: one bucket per service, so a secured
        bus lets only that service write it (services.adapters.bus.security.snapshot_bucket). Only a write
        creates it; reading an absent one answers None."""
        bucket = snapshot_bucket(self.partition, name)
        if bucket not in self._obs:
            try:
                self._obs[bucket] = await self.js.object_store(bucket)
            except (BucketNotFoundError, NotFoundError):
                if not create:
                    return None
                # as many replicas as the event stream: a snapshot must survive what the stream does
                self._obs[bucket] = await self.js.create_object_store(
                    bucket, config=api.ObjectStoreConfig(bucket=bucket, replicas=self.settings.replicas))
        return self._obs[bucket]

    async def put_snapshot(self, name: str, data: bytes) -> None:
        obs = await self._objects(name, create=True)
        await obs.put(token(name), data)

    async def get_snapshot(self, name: str) -> bytes | None:
        obs = await self._objects(name, create=False)
        if obs is None:
            return None
        for attempt in range(3):
            try:
                # nats-py reads an object through an ordered consumer with no deadline: one lost
                # with its server (a cluster member killed) would hang the read, and a service
                # starting then, for good. Bounded, and asked again on a fresh consumer.
                res = await wait_for(obs.get(token(name)), self.snapshot_timeout_s)
                return res.data
            except (NotFoundError, ObjectNotFoundError):
                return None
            except TimeoutError:
                log.warning("snapshot_read_timeout", name=name, attempt=attempt + 1)
        raise TimeoutError(f"snapshot {name!r}: no answer from the object store in 3 x {self.snapshot_timeout_s:g} s")

    async def dead_letters(self) -> list[DeadLetter]:
        info = await self.js.stream_info(self.dlq_stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            if info.state.messages == 0:
                break
            m = await self.js.get_msg(self.dlq_stream, seq)
            h = m.headers or {}
            out.append(DeadLetter(h.get(DLQ_SUBJECT, ""), h.get(DLQ_REASON, ""), h.get(DLQ_CONSUMER, ""),
                                  int(h.get(DLQ_SEQ, 0)), m.data or b""))
        return out

    async def _dead_letter(self, consumer: str, seq: int, subject: str, data: bytes, reason: str) -> None:
        self.dead_lettered += 1
        log.error("dead_letter", consumer=consumer, seq=seq, subject=subject, reason=reason)
        if not await dead_letter(self, consumer, seq, subject, data, reason):
            self.dead_letters_failed += 1

    async def close(self) -> None:
        if self._owns_connection and not self.nc.is_closed:
            await self.nc.drain()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _consumer_state(info: api.ConsumerInfo) -> ConsumerState:
    """The fields of a ``ConsumerInfo`` that tell whether a consumer keeps up."""
    cfg = info.config
    return ConsumerState(name=info.name, durable=bool(getattr(cfg, "durable_name", None)),
                         filter=getattr(cfg, "filter_subject", None) or "",
                         pending=int(info.num_pending or 0) + int(info.num_ack_pending or 0),
                         delivered=info.delivered.stream_seq if info.delivered else 0,
                         ack_floor=info.ack_floor.stream_seq if info.ack_floor else 0,
                         leader=(info.cluster.leader or "") if info.cluster else "")


def _durable_config(durable: str, start: int, subjects: str) -> api.ConsumerConfig:
    """A durable pull consumer starting at ``start``. ``name`` too: nats-py then sends the
    filtered create subject, the only one a secured bus grants (security.py, READS).

    Its state is kept in the server's memory (``mem_storage``), not in a file. Every reader of
    ours starts from a position of its own (a service at its snapshot + 1, the recorder after
    the last row it wrote: ``bus.consumer(durable, start_seq=...)``), never from the
    durable's ack floor, so a file of that floor was written for nothing: nats-server rewrote
    and renamed each durable's ``o.dat`` as its delivered sequence and ack floor moved, up to
    ten times a second per durable (a third of an idle server's CPU in ``perf``; under load,
    27 renames a second). A server restart loses a memory-stored consumer: the reader's next
    pull request finds no responder (503) and the consumer is made again right after the
    last message it handed out (:meth:`_NatsConsumer._recreate`), as ephemeral readers
    always were. The stream itself stays on disk."""
    return api.ConsumerConfig(
        name=durable, durable_name=durable, ack_policy=api.AckPolicy.ALL, max_ack_pending=100_000,
        ack_wait=30.0, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start, filter_subject=subjects, max_waiting=16, mem_storage=True)


class _NatsListener:
    """An open :meth:`NatsBus.listen` (a core NATS subscription)."""

    def __init__(self, subject: str, sub) -> None:
        self.subject, self._sub = subject, sub

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):  # a closed connection has nothing left to release
                await sub.unsubscribe()


def _quiet_callbacks(opts: dict, name: str) -> None:
    """One log line per connection event instead of nats-py's default error callback, which logs
    a traceback for every failed reconnect attempt (a console flood while a server is down)."""
    state = {"down": False, "errors": 0}

    async def on_error(exc: BaseException) -> None:
        state["errors"] += 1
        if not state["down"] or state["errors"] % 30 == 1:  # while down: one line a minute or so
            log.warning("nats_error", client=name, error=f"{type(exc).__name__}: {exc}".rstrip(": "),
                        errors=state["errors"])

    async def on_disconnected() -> None:
        if not state["down"]:
            state["down"], state["errors"] = True, 0
            log.warning("nats_disconnected", client=name)

    async def on_reconnected() -> None:
        state["down"] = False
        log.info("nats_reconnected", client=name)

    opts.setdefault("error_cb", on_error)
    opts.setdefault("disconnected_cb", on_disconnected)
    opts.setdefault("reconnected_cb", on_reconnected)


#: pull-request lifetime of an ephemeral consumer (see _NatsConsumer.expires_s)
EPHEMERAL_EXPIRES_S = 2.0

#: How long the look for a consumer that stopped answering (a 503 on its pull request), and the
#: making of it again, wait for JetStream's answer: during an election the call goes unanswered,
#: and the client's default 5 s put a whole extra wait between the new leader and the reader (a
#: killed nats-server of the compose stack: a route took more than the gateway's 10 s). A look
#: that times out sends a pull request again, which is the probe: the new leader answers it with
#: messages, a leaderless consumer with another 503. Past :data:`RECREATE_SLOW_AFTER` failed looks
#: or re-opens (a cluster slower than any election) they wait the client's default, so a lost
#: consumer is still found, and a re-open still ends, on a JetStream that answers slowly.
RECREATE_TIMEOUT_S = 1.0
RECREATE_SLOW_AFTER = 20

#: JetStream status codes on a pull consumer's inbox (they carry no stream message).
_STATUS_HEARTBEAT = "100"
_STATUS_DONE = {"404", "408", "409"}  # no messages / request expired / request closed (e.g. limits)


class _NatsConsumer:
    """A JetStream pull consumer (durable, or ephemeral when ``durable`` is None).

    Messages arrive on a private inbox and are buffered by a callback; :meth:`fetch` asks the
    server for the next ``batch`` (a long poll that expires after ``expires_s``). While one
    request is still owed more than half a batch nothing new is asked; below that the next
    request is sent before the buffer runs dry, so a busy stream is read at push-consumer speed
    and an idle one waits on one parked request.
    """

    def __init__(self, bus: NatsBus, durable: str | None, start_seq: int | None, subjects: str,
                 batch_acks: int, batch: int = 2048, expires_s: float = 5.0,
                 ack_delay_s: float = 1.0) -> None:
        self.bus, self.durable, self.start_seq, self.subjects = bus, durable, start_seq, subjects
        self.name = durable or "ephemeral"
        self.batch_acks, self.batch = batch_acks, batch
        #: an ephemeral consumer acknowledges nothing, so what the server handed it is all that
        #: tells its progress (the gateway's /health, consumers.py): a reader that stopped keeps
        #: being handed messages until its pull request expires, so ephemerals ask for short ones
        self.expires_s = expires_s if durable else min(expires_s, EPHEMERAL_EXPIRES_S)
        #: an idle consumer sends its pending ack this long after the oldest unsent one, not at
        #: every wake-up: one socket write per wake-up was most of the router's CPU per request.
        #: 1 s, not 0.1: every ack that moves a durable's floor is a consumer-state file write in
        #: nats-server (o.dat, written again and renamed, at most 10 a second per durable), and
        #: an idle stack's heartbeats and ticks arrive ~5 a second: at 0.1 s each idle event cost
        #: each durable an ack, a Python wake-up and a file write (34% of nats-server's idle
        #: samples in perf, docs/experiments.md "Against the real Dynamo"). A crash redelivers that last
        #: second of events, which every reader skips by sequence; an orderly close confirms it.
        self.ack_delay_s = ack_delay_s
        self._ack_due: float | None = None  # loop time the pending ack is due (None: nothing pending)
        self._consumer: str | None = None
        self._buf: deque = deque()
        self._wake = asyncio.Event()
        self._sub = None
        self._inbox = ""
        self._owed: deque[list] = deque()  # [messages still owed, loop time the request expires]
        self._last_seen = 0
        self._ack_target = 0
        self._acked = 0
        self._ack_msgs: dict[int, object] = {}
        self.reused = False  # the durable was kept from an earlier run (tests, logs)
        self._gone = False  # the consumer no longer answers on the server (see _recreate)
        self._recreate_tries = 0  # failed looks for the consumer since it stopped answering
        #: the look's API timeout (RECREATE_TIMEOUT_S; `evolving bench failover` runs the reader
        #: with the client's 5 s as its baseline)
        self.recreate_timeout_s = RECREATE_TIMEOUT_S
        self.looks = 0  # times a 503 sent it looking for its consumer (tests, bench)
        self._last_cseq = 0  # consumer sequence of the last message taken from this consumer
        #: reading the whole partition: every stream sequence comes to it, so a skipped one is a loss
        self._whole = subjects == all_subjects(bus.partition)
        self._reopen = False  # deliveries were lost in transit: start again after _last_seen
        self.gaps = 0  # times that happened (tests, logs)

    async def _open_durable(self) -> int:
        """Keep or (re)create the durable; return the start sequence of a new one (0 = kept)."""
        js, stream = self.bus.js, self.bus.stream
        try:
            info = await js.consumer_info(stream, self.durable)
        except NotFoundError:
            return max(self.start_seq or 1, 1)
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        delivered = info.delivered.stream_seq if info.delivered else 0
        clean = (delivered <= floor and info.config.filter_subject == self.subjects
                 and info.config.deliver_subject is None and bool(info.config.mem_storage))
        if clean and self.start_seq in (None, floor + 1):
            self.reused = True
            return 0
        reason = ("unacknowledged tail" if delivered > floor else "new start" if info.config.mem_storage
                  else "state kept in a file")  # made by an earlier version (_durable_config)
        log.info("consumer_recreated", consumer=self.durable, ack_floor=floor, delivered=delivered,
                 start_seq=self.start_seq, reason=reason)
        await js.delete_consumer(stream, self.durable)
        return max(self.start_seq if self.start_seq is not None else floor + 1, 1)

    async def _create_durable(self, start: int, timeout: float | None = None) -> None:
        await self.bus.js.add_consumer(self.bus.stream, config=_durable_config(self.durable, start, self.subjects),
                                       timeout=timeout)

    async def _reopen_after_gap(self) -> None:
        """Deliveries were lost on the way (the consumer sequence jumped, or a stream sequence
        was skipped by a consumer of the whole partition: messages the server handed out while
        the connection died, e.g. every server of the cluster restarted). The first message
        of the new consumer is taken as it comes (a range deleted by the stream's limits is
        skipped once, not reopened for ever). A
        durable would acknowledge them unseen with the next cumulative ack, an ephemeral one
        would never send them again: start a consumer again right after the last message
        handed out (the recorder lost 3 events this way in `evolving chaos`, restart-all-nats)."""
        start = self._last_seen + 1
        timeout = self._look_timeout()  # as short as a look for a lost one: it happens in elections too
        try:
            if self.durable:
                with contextlib.suppress(NotFoundError):
                    await wait_for(self.bus.js.delete_consumer(self.bus.stream, self.durable), timeout)
                await self._create_durable(start, timeout)
            else:
                with contextlib.suppress(Exception):  # the old one expires by itself
                    await wait_for(self.bus.js.delete_consumer(self.bus.stream, self._consumer), timeout)
                self._consumer = await self._add_ephemeral(start, timeout)
        except Exception as exc:  # noqa: BLE001 - JetStream not back yet: try again on the next wake-up
            self._recreate_tries += 1
            log.debug("consumer_reopen_failed", consumer=self.name, error=str(exc) or type(exc).__name__,
                      timeout_s=timeout)
            await asyncio.sleep(0.25)
            return
        self._recreate_tries = 0
        self._reopen, self._gone = False, False
        self._buf.clear()  # the old consumer's: the new one delivers them again
        self._owed.clear()
        self._last_cseq = 0
        self._ack_msgs.clear()  # acks of the old consumer's messages mean nothing to the new one
        self._acked, self._ack_due = self._ack_target, None
        log.warning("consumer_recreated", consumer=self.name, start_seq=start, reason="deliveries lost in transit")

    async def __aenter__(self) -> Self:
        if self.durable:
            start = await self._open_durable()
            self._consumer = self.durable
            if start:
                await self._create_durable(start)
        else:
            self._consumer = await self._add_ephemeral(max(self.start_seq or 1, 1))
        nc = self.bus.nc
        self._inbox = nc.new_inbox()
        self._sub = await nc.subscribe(self._inbox, cb=self._on_msg, pending_msgs_limit=-1,
                                       pending_bytes_limit=-1)
        return self

    async def _on_msg(self, msg) -> None:
        status = (msg.headers or {}).get("Status") if not msg.reply else None
        if status is None:
            if self._owed:
                self._owed[0][0] -= 1
                if self._owed[0][0] <= 0:
                    self._owed.popleft()
            self._buf.append(msg)
        elif status in _STATUS_DONE and self._owed:
            self._owed.popleft()
        elif status == "503":
            self._gone = True  # no consumer answers its pull requests any more
        self._wake.set()

    async def _add_ephemeral(self, start: int, timeout: float | None = None) -> str:
        # named (random, after the account: the gateway's /health names an engine's stuck reader by
        # it): nats-py then sends the filtered create subject (see _open_durable's caller)
        info = await self.bus.js.add_consumer(self.bus.stream, config=api.ConsumerConfig(
            name=f"{self.bus.account or 'eph'}-{secrets.token_hex(8)}", ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start, filter_subject=self.subjects, inactive_threshold=30.0, mem_storage=True),
            timeout=timeout)
        return info.name

    def _look_timeout(self) -> float:
        """The API timeout of the next look for (or making of) the consumer: short during an
        election, the client's default once that many have failed (see RECREATE_TIMEOUT_S)."""
        return self.recreate_timeout_s if self._recreate_tries < RECREATE_SLOW_AFTER else 5.0

    async def _recreate(self) -> None:
        """The consumer no longer answers: its server restarted (memory-stored consumers, ours
        all, are not kept) or, for an ephemeral one, this client was away past the inactivity
        threshold. Make a new one that starts after the last message handed out, so the reader
        neither stalls nor reads twice. A durable that is still there (no responder for a
        moment: a leader election in a cluster) is kept as it is."""
        self._gone = False
        self.looks += 1
        start = self._last_seen + 1 if self._last_seen else max(self.start_seq or 1, 1)
        timeout = self._look_timeout()
        try:
            if self.durable:
                try:
                    await self.bus.js.consumer_info(self.bus.stream, self.durable, timeout=timeout)
                    self._recreate_tries = 0
                    await asyncio.sleep(0.2)  # still there: ask again shortly
                    self._owed.clear()
                    return
                except NotFoundError:
                    await self._create_durable(start, timeout)
            else:
                # one that timed out but was made after all expires unused (inactive_threshold)
                self._consumer = await self._add_ephemeral(start, timeout)
        except Exception as exc:  # noqa: BLE001 - JetStream not back yet: pull again (the probe), then look again
            self._recreate_tries += 1
            log.debug("consumer_recreate_failed", consumer=self.name, error=str(exc) or type(exc).__name__,
                      timeout_s=timeout)
            await asyncio.sleep(0.25)
            self._owed.clear()
            return
        self._recreate_tries = 0
        self._owed.clear()
        self._last_cseq = 0
        self._ack_msgs.clear()  # acks of the lost consumer's messages mean nothing to the new one
        self._acked, self._ack_due = self._ack_target, None
        log.info("consumer_recreated", consumer=self.name, start_seq=start, reason="consumer lost")

    async def fetch(self, batch: int | None = None) -> None:
        """Ask JetStream for the next ``batch`` messages (they arrive on the inbox)."""
        n = batch or self.batch
        loop = asyncio.get_running_loop()
        self._owed.append([n, loop.time() + self.expires_s])
        req = {"batch": n, "expires": int(self.expires_s * 1e9)}
        await self.bus.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.bus.stream}.{self._consumer}",
                                  json.dumps(req).encode(), reply=self._inbox)

    async def _top_up(self) -> None:
        now = asyncio.get_running_loop().time()
        while self._owed and self._owed[0][1] < now:  # expired without a status (lost): forget it
            self._owed.popleft()
        if sum(o[0] for o in self._owed) < self.batch // 2 and len(self._owed) < 2:
            await self.fetch()

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iter()

    def _may_fetch(self) -> bool:
        """Whether :meth:`_top_up` could do anything: a request to forget (expired) or to send
        (under two owed, less than half a batch owed). Checked inline per message: the common
        case, one request owing more than half a batch, costs no coroutine."""
        owed = self._owed
        if not owed or (len(owed) == 1 and owed[0][0] < self.batch // 2):
            return True
        return owed[0][1] < asyncio.get_running_loop().time()

    async def _iter(self) -> AsyncIterator[Delivery]:
        buf = self._buf
        while True:
            if self._reopen:
                await self._reopen_after_gap()
                continue
            if self._gone and not buf:
                await self._recreate()
            if len(buf) < self.batch // 2 and self._may_fetch():
                await self._top_up()
            if not buf:
                # Let the client's reader hand over what it already read before sleeping:
                # one wake-up then serves a batch instead of a single message.
                await asyncio.sleep(0)
                if buf:
                    continue
                loop = asyncio.get_running_loop()
                wait = self.expires_s
                if self.durable and self._ack_target > self._acked:
                    now = loop.time()
                    if self._ack_due is None:
                        self._ack_due = now + self.ack_delay_s
                    if now >= self._ack_due:
                        await self.flush()
                    else:
                        wait = self._ack_due - now  # wake to send it if nothing comes first
                self._wake.clear()
                # Bounded sleep: a request whose expiry status got lost (a reconnect) must not
                # park the consumer for good; a timer handle is cheaper than wait_for's task.
                timer = loop.call_later(wait, self._wake.set)
                await self._wake.wait()
                timer.cancel()
                continue
            msg = buf.popleft()
            meta = msg.metadata
            seq, cseq = meta.sequence.stream, meta.sequence.consumer
            if self._last_cseq and seq > self._last_seen + 1 and (cseq > self._last_cseq + 1 or self._whole):
                self.gaps += 1
                self._reopen = True  # consumer sequences skipped: deliveries lost, read them again
                continue
            self._last_cseq = max(self._last_cseq, cseq)
            if seq <= self._last_seen:
                continue  # redelivery of something already handed out
            self._last_seen = seq
            if self.durable:
                self._ack_msgs[seq] = msg
            event, reason = decode_or_reason(msg.data, msg.headers)
            if event is None:
                await self.bus._dead_letter(self.name, seq, msg.subject, msg.data, reason)
                await self.ack(seq)
                continue
            yield Delivery(seq, msg.subject, event, msg.headers or {})

    async def pending(self) -> int | None:
        if self._consumer is None:
            return None
        try:
            info = await self.bus.js.consumer_info(self.bus.stream, self._consumer)
        except Exception:  # noqa: BLE001 - cannot ask now (the port: None)
            return None
        return int(info.num_pending or 0)

    async def ack(self, seq: int) -> None:
        """Cumulative ack up to ``seq``; sent every ``batch_acks`` messages, and by an idle
        consumer ``ack_delay_s`` after the oldest unsent one (so an idle consumer never holds an
        unsent ack for longer, and a steady trickle of events costs no write per event)."""
        if seq <= self._ack_target or not self.durable:
            return
        self._ack_target = seq
        if seq - self._acked >= self.batch_acks:
            await self.flush()

    async def flush(self, confirm: bool = False) -> None:
        """Send the pending cumulative ack now; ``confirm`` waits until JetStream has applied
        it (on close, so the next run finds the durable at the position this one reached)."""
        if not self.durable or self._ack_target <= self._acked:
            return
        target = self._ack_target
        msg = self._ack_msgs.get(target)
        if msg is None:
            return
        if confirm:
            try:
                await msg.ack_sync(timeout=2.0)
            except Exception as err:  # noqa: BLE001 - unconfirmed: the next run may redeliver (idempotent)
                log.warning("ack_unconfirmed", consumer=self.name, seq=target, error=str(err))
        else:
            await msg.ack()
        self._acked = target
        self._ack_due = None
        for s in [s for s in self._ack_msgs if s <= target]:
            del self._ack_msgs[s]

    async def __aexit__(self, *exc) -> None:
        try:
            if self.bus.nc.is_connected:
                await self.flush(confirm=True)
                await self.bus.nc.flush()
        finally:
            if self._sub is not None:
                try:
                    await self._sub.unsubscribe()
                except Exception as err:  # noqa: BLE001 - the connection may already be gone
                    log.debug("unsubscribe_failed", consumer=self.name, error=str(err))
            if not self.durable and self._consumer and self.bus.nc.is_connected:
                with contextlib.suppress(Exception):
                    await self.bus.js.delete_consumer(self.bus.stream, self._consumer)
