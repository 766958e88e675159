"""Waits that end on what the stream shows, not on a fixed time: how long to wait for engine
work is a question of whether the engines are still doing any.

On a loaded machine the engines (and their one-by-one publishers) fall minutes behind the wall
clock, so a fixed deadline turns "still working" into "hung" (the 1,830 requests of the 03:43
run in docs/chaos.md: all still finishing when the old 240 s drain ended). :class:`Progress`
watches the harness's copy of the stream for events that only running work makes - a request
started, its first token, its end, an iteration of an engine - and a wait built on it ends when
its condition holds or when *nothing* of that kind has arrived for ``stall_s``: then whatever
is still open has stopped, whatever the load. ``cap_s`` only bounds a run that never settles.
"""

from __future__ import annotations

import time

from events.catalog import FirstToken, IterationDone, RequestFinished, RequestStarted, Tick

#: events only work in progress makes (a heartbeat or a registration says a process is alive,
#: not that any request moves)
WORK = (RequestStarted, FirstToken, RequestFinished, IterationDone)


class Progress:
    """When work last moved on ``tail`` (the harness's :class:`~services.drivers.chaos.tail.Tail`),
    scanned incrementally from delivery ``since`` (default: where it stands when the watch begins)."""

    def __init__(self, tail, stall_s: float = 45.0, since: int | None = None, clock=time.monotonic) -> None:
        self.tail, self.stall_s, self.clock = tail, stall_s, clock
        self._i = len(tail.deliveries) if since is None else since
        self.last = clock()
        self.moves = 0  # work events seen since the watch began
        self.ticks = 0  # the planner's Ticks seen since the watch began

    def poll(self) -> None:
        new = self.tail.deliveries[self._i:]
        self._i += len(new)
        n = sum(1 for d in new if type(d.event) in WORK)
        self.ticks += sum(1 for d in new if type(d.event) is Tick)
        if n:
            self.moves += n
            self.last = self.clock()

    def stalled(self) -> bool:
        """No work moved for ``stall_s`` (polls first)."""
        self.poll()
        return self.clock() - self.last > self.stall_s

    def idle_s(self) -> float:
        return self.clock() - self.last
