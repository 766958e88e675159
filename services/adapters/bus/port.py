"""The bus port: what every service needs from the bus, and the types it hands out.

``Bus`` and ``Consumer`` are ``typing.Protocol`` s that both backends satisfy and every service
is typed against: :class:`services.adapters.bus.nats_bus.NatsBus` (NATS JetStream) and its
in-process twin :class:`services.adapters.bus.memory.InMemoryBus`. Both pass the same contract
tests (``tests/contract/test_bus.py``).

Delivery semantics (both backends):

- Every event is published on its subject (``events.subjects.subject_for``) with the schema
  version header; an optional ``msg_id`` becomes ``Nats-Msg-Id`` and a duplicate inside the
  stream's duplicate window is not stored twice (the original's sequence is returned).
- A durable consumer delivers in stream order with the stream sequence, and resumes after the
  last sequence it acknowledged, so nothing acknowledged is redelivered and nothing
  unacknowledged is lost. On JetStream it is a **pull** consumer: the client asks for batches
  (``fetch(batch)``) and reads each message's stream sequence from ``msg.metadata``. The durable
  is kept across restarts when it is clean (everything delivered was acknowledged, and the
  caller does not ask for another start position); otherwise (a crash left delivered but
  unacknowledged messages, or a snapshot asks to resume at an older position) it is re-created at
  ``ack floor + 1`` (or the asked position), because JetStream would redeliver the unacknowledged
  tail only after ``ack_wait``, behind newer messages, and every core folds in stream order.
  Acks are cumulative (``AckPolicy.ALL``) and sent in batches; a consumer must still be
  idempotent on the sequence (``services.cores.contract.Sequenced``), since a crash between applying and
  acking redelivers.
- A message that fails to decode (garbage, newer major schema) is copied to the dead-letter
  subject ``eidlq.<partition>.<account>`` with the reason and the consumer in headers, logged,
  counted, and skipped; the consumer goes on (:func:`decode_or_reason` says which). The subject
  names the bus's *account* (``bus.account``, the NATS user: the one dead-letter subject its
  permissions allow), not the consumer: an engine's or the gateway's ephemeral consumer once
  dead-lettered to ``eidlq.<p>.ephemeral``, was refused, and its consumer stopped for good.
  :func:`dead_letter` never raises: a dead letter the bus does not take is logged whole.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self, runtime_checkable

from events import codec
from events.catalog import AnyEvent, Event
from events.subjects import dlq_subject
from services.adapters.aio import wait_for
from services.adapters.logging import get_logger

DLQ_REASON = "Ei-Dlq-Reason"
DLQ_SUBJECT = "Ei-Dlq-Subject"
DLQ_SEQ = "Ei-Dlq-Seq"
DLQ_CONSUMER = "Ei-Dlq-Consumer"
MSG_ID = "Nats-Msg-Id"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event as delivered: its stream sequence, subject, typed event and headers."""

    seq: int
    subject: str
    event: AnyEvent
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    subject: str
    reason: str
    consumer: str
    seq: int
    data: bytes


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` is one token, ``>`` the rest (one or more tokens)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def decode_or_reason(data: bytes, hdrs: Mapping[str, str] | None) -> tuple[AnyEvent | None, str]:
    """The event of a stored message, or ``(None, why)`` when it is to be dead-lettered."""
    try:
        return codec.decode_message(data, hdrs), ""
    except codec.CodecError as exc:
        return None, exc.reason


@runtime_checkable
class Consumer(Protocol):
    """An open subscription to a partition's stream: async-iterate :class:`Delivery` in stream
    order, ``ack(seq)`` cumulatively, ``flush()`` pending acks. Use as an async context manager."""

    name: str

    def __aiter__(self) -> AsyncIterator[Delivery]: ...

    async def ack(self, seq: int) -> None: ...

    async def flush(self) -> None: ...

    async def pending(self) -> int | None:
        """Messages of its subjects the bus still holds for this reader and has not handed it
        (0: it is at the head); None when the bus cannot say now. On NATS a message the server
        already sent may still be on its way, so 0 is final only when it is read twice."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc) -> None: ...


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """The partition's stream as the bus sees it now (:meth:`Bus.stream_info`)."""

    last_seq: int
    messages: int  # held now (a stream with limits may have dropped the oldest)
    replicas: int  # 1 in process
    dead_letters: int  # messages on the partition's dead-letter subject(s)
    bytes: int = 0  # what the stream holds, as the backend counts it (JetStream adds subjects, headers)
    leader: str = ""  # the server that leads the stream ("" in process)
    replicas_current: int = 1  # replicas up to date: the leader and its current followers


@dataclass(frozen=True, slots=True)
class ConsumerState:
    """One reader of the partition's stream as the bus sees it (:meth:`Bus.consumers`)."""

    name: str
    durable: bool
    filter: str  # its subject filter
    pending: int  # not yet handed to it, plus handed and not acknowledged (durables)
    delivered: int  # stream sequence of the last message handed to it
    ack_floor: int  # the last sequence it acknowledged (an ephemeral needs no ack: what it was handed)
    leader: str = ""  # the server that leads it in a cluster ("" for one server or an in-memory bus)

    @property
    def position(self) -> int:
        """How far it got: a durable acknowledges what it folded (its floor); an ephemeral
        acknowledges nothing, so what it was handed is its position."""
        return self.ack_floor if self.durable else self.delivered


@dataclass(frozen=True, slots=True)
class Connection:
    """Whether the bus reaches its server now (:meth:`Bus.connection`)."""

    connected: bool
    reconnecting: bool = False
    server: str | None = None  # ``host:port`` of the server connected to; None in process or while down


@dataclass(frozen=True, slots=True)
class Message:
    """A message on a plain (not stored) subject: :meth:`Bus.listen`, :meth:`Bus.request`."""

    subject: str
    data: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


#: A listener's handler: the reply's bytes, or None for no reply (a request then times out).
Handler = Callable[[Message], Awaitable[bytes | None]]


class NoResponder(LookupError):
    """Nobody listens on the subject a :meth:`Bus.request` was sent to (answered at once)."""


@runtime_checkable
class Listener(Protocol):
    """An open :meth:`Bus.listen`; ``close()`` stops it (idempotent, never raises)."""

    subject: str

    async def close(self) -> None: ...


@runtime_checkable
class Bus(Protocol):
    """What every service needs from the bus (``NatsBus`` on JetStream, ``InMemoryBus`` in
    process); ``tests/contract/test_bus.py`` holds both to it."""

    partition: str
    dead_lettered: int
    #: where another process reaches this bus (``nats://host:port`` of the server connected to);
    #: None in process
    url: str | None

    async def publish(self, event: Event, *, msg_id: str | None = None, shadow: str | None = None) -> int: ...

    async def publish_many(self, events: Sequence[Event], *, msg_ids: Sequence[str] | None = None,
                           shadow: str | None = None) -> list[int]: ...

    async def publish_raw(self, subject: str, data: bytes, headers: Mapping[str, str] | None = None,
                          msg_id: str | None = None) -> int: ...

    async def last_seq(self) -> int: ...

    async def stream_info(self) -> StreamInfo: ...

    async def consumers(self) -> list[ConsumerState]:
        """Every reader of the partition's stream (durables, and the ephemerals open now), by name."""
        ...

    def connection(self) -> Connection:
        """Whether the bus reaches its server now (the in-process bus always does)."""
        ...

    def for_partition(self, partition: str) -> Bus:
        """A bus for another partition over the same connection (same settings and account); the
        same partition's handles all see one stream. Closing it closes nothing shared."""
        ...

    def consumer(self, durable: str | None, *, start_seq: int | None = None,
                 subjects: str | None = None) -> Consumer: ...

    async def consumer_ack_floor(self, durable: str) -> int | None:
        """The last sequence the durable consumer acknowledged (0: none yet); None when no such
        durable exists."""
        ...

    async def rewind_consumer(self, durable: str, start_seq: int) -> None:
        """Move a durable consumer (re-created with its subject filter, or made) so that the next
        reader opened with its name starts at ``start_seq``; its ack floor is then
        ``start_seq - 1`` (an operator's reset; chaos's rewind). A reader open on it now must
        skip what it already handed out (every core is idempotent on the sequence)."""
        ...

    async def listen(self, subject: str, handler: Handler) -> Listener:
        """Hand every message published on ``subject`` (wildcards allowed; an event's subject
        too: a stored publish reaches listeners as it is stored) to ``handler``, from the time
        this returns; a handler's reply answers a :meth:`request`. Nothing is kept for a late
        listener (core NATS). A handler that raises is logged and sends no reply."""
        ...

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        """Send ``data`` to a listener of ``subject`` and return its reply; raises
        :class:`NoResponder` when nobody listens, ``TimeoutError`` when no reply comes in time."""
        ...

    async def put_snapshot(self, name: str, data: bytes) -> None: ...

    async def get_snapshot(self, name: str) -> bytes | None: ...

    async def dead_letters(self) -> list[DeadLetter]: ...

    async def close(self) -> None: ...


#: How long a dead letter may take before it is given up (and logged whole instead).
DEAD_LETTER_TIMEOUT_S = 2.0


async def dead_letter(bus, consumer: str, seq: int, subject: str, data: bytes, reason: str) -> bool:
    """Copy a message a consumer will not fold to the dead-letter subject of the bus's account
    (``eidlq.<p>.<account>``; the consumer's name where the bus has no account: an open server).
    Returns whether the bus took it. Never raises and waits at most
    :data:`DEAD_LETTER_TIMEOUT_S`: a dead letter that cannot be stored (a permission the account
    lacks, a server away) is logged with its bytes (base64, first 4 KiB) and the consumer goes on.
    """
    account = getattr(bus, "account", None) or consumer
    headers = {DLQ_REASON: reason[:1000], DLQ_SUBJECT: subject[:1000], DLQ_SEQ: str(seq), DLQ_CONSUMER: consumer}
    try:
        await wait_for(bus.publish_raw(dlq_subject(bus.partition, account), data, headers=headers),
                               DEAD_LETTER_TIMEOUT_S)
        return True
    except Exception as exc:  # noqa: BLE001 - losing the copy must not stop the consumer
        get_logger("bus").error("dead_letter_failed", consumer=consumer, account=account, seq=seq, subject=subject,
                                reason=reason[:1000], error=f"{type(exc).__name__}: {exc}", bytes=len(data),
                                data_b64=base64.b64encode(data[:4096]).decode())
        return False


async def handle(handler: Handler, msg: Message) -> bytes | None:
    """Run a listener's handler as both backends do: an exception is logged (the listener goes
    on, the request gets no reply), never raised into the bus."""
    try:
        return await handler(msg)
    except Exception as exc:  # noqa: BLE001 - one bad message must not stop the listener
        get_logger("bus").warning("listener_failed", subject=msg.subject, error=f"{type(exc).__name__}: {exc}")
        return None
