"""The contract every decision core honours, and the sequence guard around it.

A core is a pure state machine: ``apply(event) -> list[Event]`` returns derived facts and
decisions; it does no I/O, reads no clock (time is the events' ``ts``) and uses no unseeded
randomness. ``snapshot()`` / ``from_snapshot()`` serialise its whole state to bytes.

:class:`Sequenced` wraps a core with the stream position it has applied, so a redelivered
message (sequence <= the applied one) changes nothing, and a snapshot records the position it
covers in the same bytes as the state (restart = snapshot + tail).
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar, runtime_checkable

import msgspec

from events.authority import Admission, Refused
from events.catalog import Event


@runtime_checkable
class Core(Protocol):
    """A pure decision core."""

    name: str

    def apply(self, event: Event) -> list[Event]: ...

    def snapshot(self) -> bytes: ...


C = TypeVar("C", bound=Core)


class _Envelope(msgspec.Struct, frozen=True):
    applied_seq: int
    core: bytes
    admission: bytes = b""  # events.authority.Admission (the stream's time): empty in older snapshots


class Sequenced(Generic[C]):
    """Applies each stream sequence at most once, in order, and only what the event authority
    admits (events/authority.py: an event delivered with its subject is checked against the
    table and the stream's time; a refused one moves the position on and raises
    :class:`events.authority.Refused`, the core never sees it)."""

    def __init__(self, core: C, applied_seq: int = 0, admission: Admission | None = None) -> None:
        self.core = core
        self.applied_seq = applied_seq
        self.skipped = 0
        self.admission = admission if admission is not None else Admission()

    def fold(self, seq: int, event: Event, subject: str | None = None) -> list[Event]:
        """Apply ``event`` at stream position ``seq``; a position already applied is a no-op.
        With ``subject`` (what the bus delivered it on) the event must pass the authority rule
        first; without one (an in-process driver) it is trusted."""
        if seq <= self.applied_seq:
            self.skipped += 1
            return []
        if subject is not None:
            why = self.admission.reason(event, subject)
            if why is not None:
                self.applied_seq = seq
                raise Refused(why)
        out = self.core.apply(event)
        self.applied_seq = seq
        return out

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_Envelope(self.applied_seq, self.core.snapshot(), self.admission.snapshot()))

    @classmethod
    def restore(cls, data: bytes, core_type: type) -> Sequenced:
        env = msgspec.msgpack.decode(data, type=_Envelope)
        adm = Admission.from_snapshot(env.admission) if env.admission else None
        return cls(core_type.from_snapshot(env.core), env.applied_seq, adm)
