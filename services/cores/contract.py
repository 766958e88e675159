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


class Sequenced(Generic[C]):
    """Applies each stream sequence at most once, in order."""

    def __init__(self, core: C, applied_seq: int = 0) -> None:
        self.core = core
        self.applied_seq = applied_seq
        self.skipped = 0

    def fold(self, seq: int, event: Event) -> list[Event]:
        """Apply ``event`` at stream position ``seq``; a position already applied is a no-op."""
        if seq <= self.applied_seq:
            self.skipped += 1
            return []
        out = self.core.apply(event)
        self.applied_seq = seq
        return out

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_Envelope(self.applied_seq, self.core.snapshot()))

    @classmethod
    def restore(cls, data: bytes, core_type: type) -> Sequenced:
        env = msgspec.msgpack.decode(data, type=_Envelope)
        return cls(core_type.from_snapshot(env.core), env.applied_seq)
