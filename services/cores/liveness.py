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

A removal also ends the requests that were decoding on that node, past their first token:
one ``RequestFinished(error="decode node N was removed mid-decode ...")`` each
(``src="liveness"``), so none stays in flight for good - at once when the engine said its KV is
gone (``NodeRemoved`` reason ``restarted`` or ``shutdown``), and for any other removal (the
watcher's own) only if the node has not registered again ``timeout_s`` after it (a node that
was only late comes back and finishes them; ``ts`` = the tick's). The router re-routes the
requests that had not reached their first token (services/cores/router/state.py).
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
    RouteDecided,
    Tick,
)

_SEEN = (NodeHeartbeat, IterationDone, RequestStarted, FirstToken, RequestFinished, RoleSwitched,
         KvStored, KvEvicted)


class _Snap(msgspec.Struct, array_like=True):
    timeout_s: float
    last_seen: list[tuple[str, float]]
    decoding: list[tuple[str, str]] = []  # (request, decode node) past the first token, not finished
    decode_of: list[tuple[str, str]] = []  # (request, decode node) of the acting route, before it
    orphaned: list[tuple[str, float]] = []  # (node, removal ts) removed for silence, not back yet
    now: float = 0.0  # ts of the last Tick folded


class LivenessWatcher:
    """Removes nodes silent for more than ``timeout_s`` (0 disables the watcher)."""

    name = "liveness"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = float(timeout_s)
        self.last_seen: dict[str, float] = {}
        self.decode_of: dict[str, str] = {}  # request -> decode node (acting route), first token not out
        self.decoding: dict[str, str] = {}  # request -> decode node, first token out, not finished
        self.orphaned: dict[str, float] = {}  # node -> ts of a removal that may be only a delay
        self.now = 0.0  # ts of the last Tick folded (the watcher's clock)

    def _track(self, event: Event) -> None:
        """Where each request decodes, from its first token on (what a removal loses)."""
        t = type(event)
        if t is RouteDecided:
            if not event.shadow:
                if event.request in self.decoding:
                    self.decoding[event.request] = event.decode_node
                else:
                    self.decode_of[event.request] = event.decode_node
        elif t is RequestStarted:
            if event.phase == "decode":
                self.decode_of.pop(event.request, None)
                self.decoding[event.request] = event.node
        elif t is FirstToken:
            node = self.decode_of.pop(event.request, None)
            if node is not None:
                self.decoding.setdefault(event.request, node)
        elif t is RequestFinished:
            self.decode_of.pop(event.request, None)
            self.decoding.pop(event.request, None)

    def _lost_with(self, node: str, ts: float, why: str) -> list[Event]:
        """``RequestFinished(error=...)`` for each request decoding on ``node``: its KV and its
        decode are gone with the node, and tokens already reached the client, so it is failed
        with a clear reason rather than prefilled again (the router re-routes what had not
        reached its first token)."""
        lost = sorted(r for r, n in self.decoding.items() if n == node)
        for r in lost:
            del self.decoding[r]
        return [RequestFinished(ts=ts, src="liveness", request=r, node=node,
                                error=f"decode node {node} was removed mid-decode ({why}); the request is lost")
                for r in lost]

    def _removed(self, ev: NodeRemoved) -> list[Event]:
        """The engine said its KV is gone (``restarted``, ``shutdown``): fail its decodes now.
        Any other removal (a heartbeat timeout) may be a node that is only late and registers
        again (docs/live.md, "Liveness that heals"), its decodes still running: they are failed
        only if it is not back ``timeout_s`` after the removal (:meth:`_expire`)."""
        reason = ev.reason or "removed"
        if reason in ("restarted", "shutdown"):
            self.orphaned.pop(ev.node, None)
            return self._lost_with(ev.node, ev.ts, reason)
        self.orphaned.setdefault(ev.node, ev.ts)
        return []

    def _expire(self, now: float) -> list[Event]:
        out: list[Event] = []
        for node in sorted(n for n, t in self.orphaned.items() if now - t > self.timeout_s):
            del self.orphaned[node]
            out += self._lost_with(node, now, f"silent, not back {self.timeout_s:g} s after its removal")
        return out

    def apply(self, event: Event) -> list[Event]:
        self._track(event)
        if isinstance(event, NodeRegistered):
            # a registration counts from when it is folded, at least: one that sat in a lagging
            # worker's queue (its ts minutes old) was removed again at the next tick, and the
            # worker's next one lagged the same way (a node that never came back under load)
            seen = max(event.ts, self.now)
            self.last_seen[event.node] = max(seen, self.last_seen.get(event.node, seen))
            self.orphaned.pop(event.node, None)  # back: its decodes run on
        elif isinstance(event, _SEEN):
            if event.node in self.last_seen:  # a node never registered is not watched
                self.last_seen[event.node] = max(event.ts, self.last_seen[event.node])
        elif isinstance(event, NodeRemoved):
            self.last_seen.pop(event.node, None)
            return self._removed(event)
        elif isinstance(event, Tick) and self.timeout_s > 0:
            self.now = max(self.now, event.ts)
            dead = sorted(n for n, t in self.last_seen.items() if event.ts - t > self.timeout_s)
            out: list[Event] = self._expire(event.ts)
            for node in dead:
                silent = event.ts - self.last_seen.pop(node)
                out.append(NodeRemoved(ts=event.ts, src="liveness", node=node,
                                       reason=f"heartbeat timeout: silent for {silent:.1f} s > {self.timeout_s:g} s"))
            return out
        return []

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_Snap(self.timeout_s, sorted(self.last_seen.items()),
                                            sorted(self.decoding.items()), sorted(self.decode_of.items()),
                                            sorted(self.orphaned.items()), self.now))

    @classmethod
    def from_snapshot(cls, data: bytes) -> LivenessWatcher:
        snap = msgspec.msgpack.decode(data, type=_Snap)
        w = cls(snap.timeout_s)
        w.last_seen = dict(snap.last_seen)
        w.decoding, w.decode_of, w.orphaned = dict(snap.decoding), dict(snap.decode_of), dict(snap.orphaned)
        w.now = snap.now
        return w
