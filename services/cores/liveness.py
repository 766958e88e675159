"""Heartbeat watcher: a node that goes silent is removed. Pure: no I/O, no clock.

Decision (docs/live.md, "Liveness"): the **planner service** runs this watcher beside the
planner core, because the planner adapter is the one that publishes ``Tick``. Every event
published by an engine about itself (``NodeRegistered``, ``NodeHeartbeat``, ``IterationDone``,
``RequestStarted``, ``FirstToken``, ``RequestFinished``, ``RoleSwitched``, KV facts) is a sign of
life at its ``ts``, and refreshes the node's *last seen* time. Time is only ever ``event.ts``
(engines and the planner adapter stamp wall-clock seconds), so a replay of the log decides the
same removals at the same ticks.

**A slow node is not a dead one.** Under load an engine's events reach the stream
late and its loop runs late, but it goes on. So:

* A ``NodeHeartbeat`` (sent from a thread of the engine's own, engine/worker/publish.py) is life
  at its ``ts`` when the node *progressed* since its previous heartbeat (its folded sequence
  ``applied_seq`` or its ``published`` count moved) or its loop is not late (``loop_lag_s`` 0);
  otherwise - the heartbeat thread alive, the loop stuck - only at ``ts - loop_lag_s``, when the
  loop last answered. A node whose loop has stopped is therefore still removed.
* The **grace** a node gets scales with the jitter of its own silences: each time a node speaks
  after at least one tick of silence, that silence (the last tick's ``ts`` minus its previous
  *last seen*) is one sample of a window of its last ``window`` ones; the grace is
  ``min(max_grace_s, max(timeout_s, jitter_factor * p99))`` (p99 by nearest rank). A node whose
  events come every second keeps the ``timeout_s`` grace; one that has gone silent for 4 s under
  load gets 12 s; a dead node stops adding samples, and is removed within ``max_grace_s`` (3
  ``timeout_s`` by default) of its last sign of life, whatever its history.

On a ``Tick`` with ``ts - last_seen > grace`` the watcher emits
``NodeRemoved(reason="heartbeat timeout: silent for S s > G s")`` (``ts`` = the tick's) and
forgets the node; a later ``NodeRegistered`` brings it back.

A removal also ends the requests that were decoding on that node, past their first token:
one ``RequestFinished(error="decode node N was removed mid-decode ...")`` each
(``src="liveness"``), so none stays in flight for good - at once when the engine said its KV is
gone (``NodeRemoved`` reason ``restarted`` or ``shutdown``), and for any other removal (the
watcher's own) only if the node has not registered again ``timeout_s`` after it (a node that
was only late comes back and finishes them; ``ts`` = the tick's). The router re-routes the
requests that had not reached their first token (services/cores/router/state.py).
"""

from __future__ import annotations

import math
from collections import deque

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


class _Snap(msgspec.Struct, array_like=True):
    timeout_s: float
    last_seen: list[tuple[str, float]]
    decoding: list[tuple[str, str]] = []  # (request, decode node) past the first token, not finished
    decode_of: list[tuple[str, str]] = []  # (request, decode node) of the acting route, before it
    orphaned: list[tuple[str, float]] = []  # (node, removal ts) removed for silence, not back yet
    now: float = 0.0  # ts of the last Tick folded
    # the rule that tells a slow node from a dead one (module docstring)
    jitter_factor: float = 3.0
    max_grace_s: float = -1.0  # -1: 3 x timeout_s (snapshots written before it)
    window: int = 128
    silences: list[tuple[str, list[float]]] = []  # (node, its last silences ended by a sign of life)
    progress: list[tuple[str, int, int]] = []  # (node, applied_seq, published) of its last heartbeat


class LivenessWatcher:
    """Removes nodes silent for longer than their grace (``timeout_s`` at least, more for a node
    whose silences have been long: module docstring); ``timeout_s`` 0 disables the watcher."""

    name = "liveness"

    def __init__(self, timeout_s: float = 10.0, jitter_factor: float = 3.0, max_grace_s: float | None = None,
                 window: int = 128) -> None:
        self.timeout_s = float(timeout_s)
        self.jitter_factor = float(jitter_factor)
        self.max_grace_s = 3.0 * self.timeout_s if max_grace_s is None or max_grace_s < 0 else float(max_grace_s)
        assert self.max_grace_s >= self.timeout_s, "invariant: the grace is never below the timeout"
        assert window >= 1, "invariant: the jitter window holds at least one silence"
        self.window = int(window)
        self.last_seen: dict[str, float] = {}
        self.decode_of: dict[str, str] = {}  # request -> decode node (acting route), first token not out
        self.decoding: dict[str, str] = {}  # request -> decode node, first token out, not finished
        self.orphaned: dict[str, float] = {}  # node -> ts of a removal that may be only a delay
        self.now = 0.0  # ts of the last Tick folded (the watcher's clock)
        self.silences: dict[str, deque[float]] = {}  # node -> its last silences ended by a sign of life
        self.progress: dict[str, tuple[int, int]] = {}  # node -> (applied_seq, published) of its last heartbeat

    # ------------------------------------------------------------------ the rule
    def grace(self, node: str) -> float:
        """How long ``node`` may stay silent: ``min(max_grace_s, max(timeout_s, jitter_factor *
        p99 of its silences))``."""
        xs = self.silences.get(node)
        if not xs:
            return self.timeout_s
        s = sorted(xs)
        p99 = s[max(0, math.ceil(0.99 * len(s)) - 1)]
        return min(self.max_grace_s, max(self.timeout_s, self.jitter_factor * p99))

    def _life(self, event: NodeHeartbeat) -> float:
        """When a heartbeat says the node was last alive: its ``ts`` if the node progressed
        since its previous heartbeat or its loop is not late, else when its loop last answered."""
        now = (event.applied_seq, event.published)
        before = self.progress.get(event.node)
        self.progress[event.node] = now
        if event.loop_lag_s <= 0 or before is None or now != before:
            return event.ts
        return event.ts - event.loop_lag_s

    def _seen(self, node: str, ts: float) -> None:
        """A sign of life of ``node`` at ``ts``; a silence that spanned a tick is a jitter sample."""
        last = self.last_seen[node]
        if ts <= last:
            return
        if self.now > last:
            xs = self.silences.get(node)
            if xs is None:
                xs = self.silences[node] = deque(maxlen=self.window)
            xs.append(self.now - last)
        self.last_seen[node] = ts

    def _track(self, event: Event) -> None:
        """Where each request decodes, from its first token on (what a removal loses)."""
        match event:
            case RouteDecided() if not event.shadow:
                if event.request in self.decoding:
                    self.decoding[event.request] = event.decode_node
                else:
                    self.decode_of[event.request] = event.decode_node
            case RequestStarted() if event.phase == "decode":
                self.decode_of.pop(event.request, None)
                self.decoding[event.request] = event.node
            case FirstToken():
                node = self.decode_of.pop(event.request, None)
                if node is not None:
                    self.decoding.setdefault(event.request, node)
            case RequestFinished():
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
        match event:
            case NodeRegistered():
                # a registration counts from when it is folded, at least: one that sat in a lagging
                # worker's queue (its ts minutes old) was removed again at the next tick, and the
                # worker's next one lagged the same way (a node that never came back under load)
                seen = max(event.ts, self.now)
                self.last_seen[event.node] = max(seen, self.last_seen.get(event.node, seen))
                self.orphaned.pop(event.node, None)  # back: its decodes run on
            case NodeHeartbeat():
                if event.node in self.last_seen:  # a node never registered is not watched
                    self._seen(event.node, self._life(event))
            case IterationDone() | RequestStarted() | FirstToken() | RequestFinished() | RoleSwitched() \
                    | KvStored() | KvEvicted():  # work from a node: a sign of life
                if event.node in self.last_seen:
                    self._seen(event.node, event.ts)
            case NodeRemoved():
                self.last_seen.pop(event.node, None)
                self.progress.pop(event.node, None)  # a new run counts from its first heartbeat
                return self._removed(event)
            case Tick() if self.timeout_s > 0:
                return self._tick(event)
        return []

    def _tick(self, event: Tick) -> list[Event]:
        """Remove every node silent past its grace (and expire orphaned decodes) at ``event.ts``."""
        self.now = max(self.now, event.ts)
        graces = {n: self.grace(n) for n in self.last_seen}
        dead = sorted(n for n, t in self.last_seen.items() if event.ts - t > graces[n])
        out: list[Event] = self._expire(event.ts)
        for node in dead:
            silent = event.ts - self.last_seen.pop(node)
            self.progress.pop(node, None)
            g = graces[node]
            why = f"{g:g} s" if g == self.timeout_s else f"{g:.1f} s (the timeout scaled by its jitter)"
            out.append(NodeRemoved(ts=event.ts, src="liveness", node=node,
                                   reason=f"heartbeat timeout: silent for {silent:.1f} s > {why}"))
        return out

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_Snap(
            self.timeout_s, sorted(self.last_seen.items()), sorted(self.decoding.items()),
            sorted(self.decode_of.items()), sorted(self.orphaned.items()), self.now, self.jitter_factor,
            self.max_grace_s, self.window, sorted((n, list(xs)) for n, xs in self.silences.items()),
            sorted((n, a, p) for n, (a, p) in self.progress.items())))

    @classmethod
    def from_snapshot(cls, data: bytes) -> LivenessWatcher:
        snap = msgspec.msgpack.decode(data, type=_Snap)
        w = cls(snap.timeout_s, snap.jitter_factor, snap.max_grace_s, snap.window)
        w.last_seen = dict(snap.last_seen)
        w.decoding, w.decode_of, w.orphaned = dict(snap.decoding), dict(snap.decode_of), dict(snap.orphaned)
        w.now = snap.now
        w.silences = {n: deque(xs, maxlen=w.window) for n, xs in snap.silences}
        w.progress = {n: (a, p) for n, a, p in snap.progress}
        return w
