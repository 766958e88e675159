"""Several pure cores folded as one, behind one consumer. Pure: no I/O, no clock.

The planner service runs the planner and the heartbeat watcher (:mod:`.liveness`) on the same
stream position; a :class:`CoreStack` applies each event to every core in order and returns
their outputs concatenated (first core's first), so message ids stay deterministic. Its
snapshot is the cores' snapshots, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from events.catalog import Event


class _StackSnap(msgspec.Struct, array_like=True):
    names: list[str]
    cores: list[bytes]


class CoreStack:
    """``apply`` folds the event through every core; ``name`` is the first core's."""

    def __init__(self, cores: Sequence) -> None:
        assert cores, "a stack holds at least one core"
        self.cores = list(cores)
        self.name = self.cores[0].name

    def apply(self, event: Event) -> list[Event]:
        out: list[Event] = []
        for core in self.cores:
            out.extend(core.apply(event))
        return out

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_StackSnap([c.name for c in self.cores], [c.snapshot() for c in self.cores]))

    @classmethod
    def restore(cls, data: bytes, restorers: Sequence[Callable[[bytes], object]]) -> CoreStack:
        snap = msgspec.msgpack.decode(data, type=_StackSnap)
        if len(snap.cores) != len(restorers):
            raise ValueError(f"stack snapshot holds {len(snap.cores)} cores, expected {len(restorers)}")
        return cls([r(b) for r, b in zip(restorers, snap.cores)])
