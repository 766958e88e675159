"""The in-process twin of the bus: :class:`InMemoryBus` (unit tests and the simulator).

It keeps JetStream's semantics (sequence, de-duplication, durable consumers, dead letters) and
passes the same contract tests as :class:`services.adapters.bus.nats_bus.NatsBus`
(``tests/contract/test_bus.py``); the semantics are in :mod:`services.adapters.bus.port`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Self

from events import codec
from events.catalog import Event
from events.subjects import DEFAULT_PARTITION, all_subjects, subject_for
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
    decode_or_reason,
    handle,
    subject_matches,
)
from services.adapters.logging import get_logger

log = get_logger("bus")


@dataclass(eq=False)
class _MemListener:
    subject: str
    handler: Handler
    _all: list = field(repr=False)

    async def close(self) -> None:
        if self in self._all:
            self._all.remove(self)


class InMemoryBus:
    """A single-process bus with JetStream's semantics (sequence, de-duplication, durable
    consumers, dead letters). Unit tests and the simulator use it."""

    def __init__(self, partition: str = DEFAULT_PARTITION) -> None:
        self.partition = partition
        self._log: list[tuple[str, bytes, dict[str, str]]] = []
        self._ids: dict[str, int] = {}
        self._acks: dict[str, int] = {}
        self._snapshots: dict[str, bytes] = {}
        self._dlq: list[DeadLetter] = []
        self._cond = asyncio.Condition()
        self.dead_lettered = 0
        self.account: str | None = None  # no accounts in process: dead letters name the consumer
        self.url: str | None = None  # nothing outside the process reaches it
        #: listeners of plain subjects, shared by every partition of this "connection" (as on NATS)
        self._listeners: list[_MemListener] = []
        self._handling: set[asyncio.Task] = set()  # handlers running (a reference keeps each alive)
        #: the buses of every partition of this "connection" (for_partition), this one included
        self._partitions: dict[str, InMemoryBus] = {partition: self}
        self._filters: dict[str, str] = {}  # durable -> its subject filter (consumers())
        self._open: list[_MemConsumer] = []  # the consumers open now, in the order they opened
        self._opened = 0  # ephemerals opened so far: each has its own name, as on JetStream

    async def publish(self, event: Event, *, msg_id: str | None = None, shadow: str | None = None) -> int:
        return await self.publish_raw(subject_for(event, self.partition, shadow), codec.encode(event),
                                      codec.headers(), msg_id=msg_id)

    async def publish_many(self, events: Sequence[Event], *, msg_ids: Sequence[str] | None = None,
                           shadow: str | None = None) -> list[int]:
        return [await self.publish(e, msg_id=None if msg_ids is None else msg_ids[i], shadow=shadow)
                for i, e in enumerate(events)]

    async def publish_raw(self, subject: str, data: bytes, headers: Mapping[str, str] | None = None,
                          msg_id: str | None = None) -> int:
        if msg_id is not None and msg_id in self._ids:
            return self._ids[msg_id]
        if subject.startswith("eidlq."):  # the dead-letter stream is another stream (as on JetStream)
            h = dict(headers or {})
            self._dlq.append(DeadLetter(h.get(DLQ_SUBJECT, subject), h.get(DLQ_REASON, ""), h.get(DLQ_CONSUMER, ""),
                                        int(h.get(DLQ_SEQ, 0) or 0), bytes(data)))
            return len(self._dlq)
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs[MSG_ID] = msg_id
        async with self._cond:
            self._log.append((subject, bytes(data), hdrs))
            seq = len(self._log)
            if msg_id is not None:
                self._ids[msg_id] = seq
            self._cond.notify_all()
        self._deliver(Message(subject, bytes(data), hdrs))
        return seq

    def _deliver(self, msg: Message) -> list[asyncio.Task]:
        """Start the handler of every listener of ``msg.subject`` (each on its own, as NATS
        calls them); returns their tasks."""
        tasks = []
        for lst in [x for x in self._listeners if subject_matches(x.subject, msg.subject)]:
            t = asyncio.ensure_future(handle(lst.handler, msg))
            self._handling.add(t)
            t.add_done_callback(self._handling.discard)
            tasks.append(t)
        return tasks

    async def listen(self, subject: str, handler: Handler) -> _MemListener:
        lst = _MemListener(subject, handler, self._listeners)
        self._listeners.append(lst)
        return lst

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        tasks = self._deliver(Message(subject, bytes(data)))
        if not tasks:
            raise NoResponder(subject)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = set(tasks)
        while pending:  # the first reply wins (NATS hands the requester the first one back)
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for t in done:
                if t.result() is not None:
                    return t.result()
        raise TimeoutError(f"no reply on {subject} within {timeout_s:g} s")

    async def last_seq(self) -> int:
        return len(self._log)

    def consumer(self, durable: str | None, *, start_seq: int | None = None,
                 subjects: str | None = None) -> _MemConsumer:
        return _MemConsumer(self, durable, start_seq, subjects or all_subjects(self.partition))

    async def put_snapshot(self, name: str, data: bytes) -> None:
        self._snapshots[name] = bytes(data)

    async def get_snapshot(self, name: str) -> bytes | None:
        return self._snapshots.get(name)

    async def dead_letters(self) -> list[DeadLetter]:
        return list(self._dlq)

    async def stream_info(self) -> StreamInfo:
        n = len(self._log)
        held = sum(len(s) + len(d) + sum(len(k) + len(v) for k, v in h.items()) for s, d, h in self._log)
        return StreamInfo(last_seq=n, messages=n, replicas=1, dead_letters=len(self._dlq), bytes=held)

    async def consumer_ack_floor(self, durable: str) -> int | None:
        return self._acks.get(durable)

    def _waiting(self, after: int, subjects: str) -> int:
        """Messages of ``subjects`` past sequence ``after``."""
        return sum(1 for s, _, _ in self._log[after:] if subject_matches(subjects, s))

    async def consumers(self) -> list[ConsumerState]:
        out: dict[str, ConsumerState] = {}
        for durable, floor in self._acks.items():  # open or not, a durable exists once opened
            subjects = self._filters.get(durable, all_subjects(self.partition))
            open_ = [c for c in self._open if c.durable == durable]
            delivered = max([c._next - 1 for c in open_] + [floor])
            out[durable] = ConsumerState(name=durable, durable=True, filter=subjects,
                                         pending=self._waiting(floor, subjects), delivered=delivered, ack_floor=floor)
        for c in self._open:
            if not c.durable:
                out[c.listed_as] = ConsumerState(name=c.listed_as, durable=False, filter=c.subjects,
                                            pending=self._waiting(c._next - 1, c.subjects), delivered=c._next - 1,
                                            ack_floor=c._next - 1)
        return [out[k] for k in sorted(out)]

    def connection(self) -> Connection:
        return Connection(connected=True)

    async def rewind_consumer(self, durable: str, start_seq: int) -> None:
        self._acks[durable] = max(start_seq, 1) - 1

    def for_partition(self, partition: str) -> InMemoryBus:
        other = self._partitions.get(partition)
        if other is None:
            other = self._partitions[partition] = InMemoryBus(partition)
            other._partitions, other._listeners, other._handling = self._partitions, self._listeners, self._handling
        return other

    async def close(self) -> None:
        pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _MemConsumer:
    def __init__(self, bus: InMemoryBus, durable: str | None, start_seq: int | None, subjects: str) -> None:
        self.bus, self.durable, self.subjects = bus, durable, subjects
        self.name = durable or "ephemeral"
        floor = bus._acks.setdefault(durable, 0) if durable else 0  # opened: it exists from now on
        if durable:
            bus._filters.setdefault(durable, subjects)
        self.listed_as = self.name
        self._next = start_seq if start_seq is not None else floor + 1
        self._next = max(self._next, 1)

    async def __aenter__(self) -> Self:
        if not self.durable:
            self.bus._opened += 1  # its name in consumers(); dead letters keep naming it "ephemeral"
            self.listed_as = f"ephemeral-{self.bus._opened}"
        self.bus._open.append(self)
        return self

    async def __aexit__(self, *exc) -> None:
        if self in self.bus._open:
            self.bus._open.remove(self)

    async def pending(self) -> int | None:
        return self.bus._waiting(self._next - 1, self.subjects)

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Delivery]:
        bus = self.bus
        while True:
            async with bus._cond:
                await bus._cond.wait_for(lambda: len(bus._log) >= self._next)
            while self._next <= len(bus._log):
                seq = self._next
                self._next += 1
                subject, data, hdrs = bus._log[seq - 1]
                if not subject_matches(self.subjects, subject):
                    continue
                event, reason = decode_or_reason(data, hdrs)
                if event is None:
                    bus._dlq.append(DeadLetter(subject, reason, self.name, seq, data))
                    bus.dead_lettered += 1
                    log.error("dead_letter", consumer=self.name, seq=seq, subject=subject, reason=reason)
                    continue
                yield Delivery(seq, subject, event, hdrs)

    async def ack(self, seq: int) -> None:
        if self.durable:
            self.bus._acks[self.durable] = max(self.bus._acks.get(self.durable, 0), seq)

    async def flush(self) -> None:
        pass
