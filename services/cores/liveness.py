"""Heartbeat watcher: a node that goes silent is removed. Pure: no I/O, no clock.

Decision (docs/live.md, "Liveness"): the **planner service** runs this watcher beside the
planner core, because the planner adapter is the one that publishes ``Tick``. Every event
published by an engine about itself (``NodeRegistered``, ``NodeHeartbeat``, ``IterationDone``,
``RequestStarted``, ``FirstToken``, ``RequestFinished``, ``RoleSwitched``, KV facts) refreshes
the node's *last seen* time, taken from the event's ``ts``. On a ``Tick`` with
``ts - last_seen > timeout_s`` the watcher emits ``NodeRemoved(reason="heartbeat timeout")``
(``ts`` = the tick's) and forgets the node; a later ``NodeRegistered`` brings it back. Time is
only ever ``event.ts`` (engines and the planner adapter stamp wall-clock seconds), so a replay
of the log decides the same removals at the same ticks.
"""

from __future__ import annotations

import msgspec

from events.catalog import (
    Event,
    FirstToken,
    IterationDone,
    KvEvicted,
    KvStored,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RoleSwitched,
    Tick,
)

_SEEN = (NodeHeartbeat, IterationDone, RequestStarted, FirstToken, RequestFinished, RoleSwitched,
         KvStored, KvEvicted)


class _Snap(msgspec.Struct, array_like=True):
    timeout_s: float
    last_seen: list[tuple[str, float]]


class LivenessWatcher:
    """Removes nodes silent for more than ``timeout_s`` (0 disables the watcher)."""

    name = "liveness"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = float(timeout_s)
        self.last_seen: dict[str, float] = {}

    def apply(self, event: Event) -> list[Event]:
        if isinstance(event, NodeRegistered):
            self.last_seen[event.node] = max(event.ts, self.last_seen.get(event.node, event.ts))
        elif isinstance(event, _SEEN):
            if event.node in self.last_seen:  # a node never registered is not watched
                self.last_seen[event.node] = max(event.ts, self.last_seen[event.node])
        elif isinstance(event, NodeRemoved):
            self.last_seen.pop(event.node, None)
        elif isinstance(event, Tick) and self.timeout_s > 0:
            dead = sorted(n for n, t in self.last_seen.items() if event.ts - t > self.timeout_s)
            out: list[Event] = []
            for node in dead:
                silent = event.ts - self.last_seen.pop(node)
                out.append(NodeRemoved(ts=event.ts, src="liveness", node=node,
                                       reason=f"heartbeat timeout: silent for {silent:.1f} s > {self.timeout_s:g} s"))
            return out
        return []

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_Snap(self.timeout_s, sorted(self.last_seen.items())))

    @classmethod
    def from_snapshot(cls, data: bytes) -> LivenessWatcher:
        snap = msgspec.msgpack.decode(data, type=_Snap)
        w = cls(snap.timeout_s)
        w.last_seen = dict(snap.last_seen)
        return w
