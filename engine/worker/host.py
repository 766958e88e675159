"""The node model's host in a worker process: ``WallClockHost`` runs the backend's callbacks on an
asyncio loop at their model time (``epoch + (wall - epoch) * time_scale``); ``RemotePeer`` is
another node as the model sees it, through the local directory (engine/worker/__init__.py, 3 and Time)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import time
from collections.abc import Callable

from engine.backend import DecodeJob
from events.catalog import Event
from events.wire import TokenMsg
from services.adapters.aio import wait_for
from services.adapters.logging import get_logger
from services.cores.directory.core import DirectoryCore

log = get_logger("worker")


class _TierView:
    """``block in view``: does ``node`` hold ``block`` in ``tier``, per the local directory. One
    lookup per block: building ``copies()`` (every block the node holds) for each test made a
    prefill's fetch plan quadratic - 1,200 blocks against a peer holding 30 K took the worker's
    loop 2-10 s under load, and the liveness watcher removed it for silence."""

    def __init__(self, directory: DirectoryCore, node: str, tier: str) -> None:
        self.d, self.node, self.tier = directory, node, tier

    def __contains__(self, block: object) -> bool:
        try:
            self.d.last_access(block, self.node, self.tier)  # KeyError: no such copy
        except KeyError:
            return False
        return True


class RemotePeer:
    """Another node as the node model sees it: its KV from the directory, its decode admission
    done by its own worker (so ``kv_arrived`` is a no-op here)."""

    def __init__(self, node: str, directory: DirectoryCore) -> None:
        self.id = node
        self.d = directory
        self.l1 = _TierView(directory, node, "L1")
        self.l2 = _TierView(directory, node, "L2")

    @property
    def status(self) -> str:
        return "up" if self.id in self.d.nodes() else "down"

    def kv_arrived(self, job: DecodeJob) -> None:
        pass


class WallClockHost:
    """``WorkerHost`` (engine/backend.py) over an asyncio loop: a heap of due callbacks run at their model time."""

    def __init__(self, time_scale: float, emit: Callable[[Event], None], choose, peer,
                 epoch: float | None = None, monotonic: Callable[[], float] = time.monotonic,
                 token: Callable[[TokenMsg], None] | None = None) -> None:
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale must be a positive number, got {time_scale}")
        self.scale = time_scale
        self._mono = monotonic
        self._m0 = monotonic()
        self._t0 = time.time() if epoch is None else epoch
        self.now = self._t0
        self._heap: list = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        #: set at every schedule (never cleared here): the worker's progress loop, with no decode
        #: run to pace, sleeps on it instead of polling (engine/worker/loop.py, ``_progress``)
        self.scheduled = asyncio.Event()
        self._emit, self._choose, self._peer, self._token = emit, choose, peer, token

    def clock(self) -> float:
        """Model time now (not ``now``: that is the time of the callback being run)."""
        return self._t0 + (self._mono() - self._m0) * self.scale

    def catch_up(self) -> float:
        """Advance ``now`` to the clock for an input from outside (never backwards)."""
        self.now = max(self.now, self.clock())
        return self.now

    # NodeHost
    def emit(self, event: Event) -> None:
        self._emit(event)

    def token(self, msg: TokenMsg) -> None:
        if self._token is not None:
            self._token(msg)

    def schedule(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))
        self._wake.set()
        self.scheduled.set()

    def choose_eviction(self, node, tier, tokens, pinned):
        return self._choose(node, tier, tokens, pinned)

    def peer(self, node):
        return self._peer(node)

    def run_due(self, budget_s: float | None = None) -> int:
        """Run every callback due by the clock (for at most ``budget_s`` of wall time, then
        return so the loop's other tasks run); returns how many ran."""
        n = 0
        until = None if budget_s is None else self._mono() + budget_s
        while self._heap and self._heap[0][0] <= self.clock():
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            fn(*args)
            n += 1
            if until is not None and self._mono() >= until:
                break
        return n

    async def run(self) -> None:
        while True:
            try:
                self.run_due(budget_s=0.05)
            except Exception as exc:  # noqa: BLE001 - one failing callback must not silence the node
                log.error("node_callback_failed", error=f"{type(exc).__name__}: {exc}")
            if self._heap and self._heap[0][0] <= self.clock():
                await asyncio.sleep(0)  # behind the clock: let heartbeats and the consumer run
                continue
            self._wake.clear()
            delay = None
            if self._heap:
                delay = max(0.0, (self._heap[0][0] - self.clock()) / self.scale)
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._wake.wait(), delay)
