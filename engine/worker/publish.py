"""The worker's way out to the bus: the publisher task that drains the queue of the node's events
and token messages in order, each event under a message id of its own and retried while the bus
cannot take it, and the heartbeats, published beside that queue from a thread and a connection
of their own (engine/worker/__init__.py, 4-6; docs/live.md, "Liveness under load")."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import threading
import time
import traceback

from nats.errors import Error as NatsError
from nats.js.errors import APIError, ServiceUnavailableError

from events.catalog import Event, NodeHeartbeat
from events.wire import TokenMsg
from services.adapters.aio import wait_for
from services.adapters.logging import get_logger

log = get_logger("worker")


def _retryable(exc: BaseException) -> bool:
    """A publication error that may pass on a retry: the bus unreachable or JetStream not
    answering (yet). A JetStream API error other than 503 (a refused message) will not."""
    if isinstance(exc, ServiceUnavailableError):
        return True
    if isinstance(exc, APIError):
        return False
    return isinstance(exc, NatsError | TimeoutError | OSError | ConnectionError)


class Publishing:
    """``EngineWorker``'s publications (engine/worker/loop.py holds the state: ``bus``, ``tokens``,
    ``_out``, ``_unechoed``, ``published``, ``publish_retries``, ``_boot``, ``_msg_seq``)."""

    async def _publisher(self) -> None:
        while True:
            item = await self._out.get()
            try:
                async with self._pub_lock:
                    if isinstance(item, TokenMsg):
                        await self.tokens.publish(item)  # core NATS: buffered by the client while it reconnects
                    else:
                        await self._publish_event(item)
            except Exception as exc:  # noqa: BLE001 - a lost publication is logged, the node goes on
                if not isinstance(item, TokenMsg):
                    self._unechoed = max(0, self._unechoed - 1)  # its echo will never come
                log.error("publish_failed", node=self.node_id, item=type(item).__name__,
                          error=str(exc) or type(exc).__name__)
            finally:
                self._out.task_done()

    async def _progress_step(self, progress) -> None:
        """One ``backend.progress()`` of the progress loop (engine/worker/loop.py). When nothing
        waits in the queue and the publisher is not handing anything to the bus, the iteration's
        token messages are published here, right after it, instead of through the queue: one
        wake-up of the publisher task (a queue put and get, a turn of the event loop) less per
        decode iteration, which is most of a streaming engine's loop turns. A token message
        emitted after an event of the same step queues behind it (``_out_token``), and the lock
        keeps the publisher from sending a later event before these, so the order on the
        connection is the order of emission, as through the queue."""
        if not self._out.empty() or self._pub_lock.locked():
            progress()
            return
        direct: list[TokenMsg] = []
        self._direct = direct
        try:
            progress()
        finally:
            self._direct = None
        if not direct:
            return
        async with self._pub_lock:
            for i, msg in enumerate(direct):
                try:
                    await self.tokens.publish(msg)
                except asyncio.CancelledError:
                    for rest in direct[i:]:  # not lost with the task: the publisher sends them
                        self._out.put_nowait(rest)
                    raise
                except Exception as exc:  # noqa: BLE001 - a lost publication is logged, the node goes on
                    log.error("publish_failed", node=self.node_id, item="TokenMsg", error=str(exc) or type(exc).__name__)

    async def _publish_event(self, event: Event) -> None:
        """Publish ``event`` with a message id of its own (``node:run:n``) and, while the bus
        cannot take it (server down, a cluster electing a leader), try again with the same id,
        in order (the queue waits): the stream's duplicate window drops a retry whose first try
        was stored after all. Retries stop inside that window (beyond it a retry could store
        the event twice); an error that a retry cannot fix (a refused event) is raised at once."""
        self._msg_seq += 1
        msg_id = f"{self.src}:{self._boot}:{self._msg_seq}"
        settings = getattr(self.bus, "settings", None)
        window = getattr(settings, "duplicate_window_s", 120.0) or 120.0
        deadline = time.monotonic() + 0.8 * window
        delay, failures = 0.05, 0
        while True:
            try:
                await self.bus.publish(event, msg_id=msg_id)
            except Exception as exc:
                if not _retryable(exc) or time.monotonic() + delay > deadline:
                    raise
                failures += 1
                if failures == 1:
                    self.publish_retries += 1
                if failures == 1 or failures % 20 == 0:
                    log.warning("publish_retrying", node=self.node_id, item=type(event).__name__, msg_id=msg_id,
                                attempt=failures, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            self.published += 1
            if failures:
                log.info("publish_recovered", node=self.node_id, item=type(event).__name__, msg_id=msg_id,
                         attempts=failures + 1)
            return

    # ------------------------------------------------------------------ heartbeats
    #: ``async () -> Bus``: a connection of the heartbeats' own (``python -m engine.worker`` gives
    #: one); None: the heartbeats are a task of the worker's loop on ``bus`` (tests, in-memory bus)
    heartbeat_bus = None
    _beater: HeartbeatThread | None = None

    def _start_heartbeats(self) -> None:
        """Heartbeats from a thread of their own with a connection of their own when the worker
        has ``heartbeat_bus``, else from a task of its loop (both through :class:`Beats`)."""
        self._load = self.backend.load()
        if self.heartbeat_bus is not None:
            self._beater = HeartbeatThread(self, self.heartbeat_bus, asyncio.get_running_loop())
            self._beater.start()
        else:
            self._tasks.append(asyncio.create_task(self._heartbeats(), name="heartbeat"))

    def _stop_heartbeats(self) -> None:
        if self._beater is not None:
            self._beater.stop()

    async def _heartbeats(self) -> None:
        """In-loop heartbeats: ``NodeHeartbeat`` every ``heartbeat_s`` of wall clock, published
        straight to ``bus`` (not queued behind the node's events: a burst of them, a drain or a
        retrying publication must not delay it past the liveness timeout). Its ``loop_lag_s`` is
        how late the loop woke for it. A heartbeat changes no core's state a restart depends on,
        so it is neither applied to the view nor waited for (its echo is skipped), and a failed
        one is only logged: the next one follows."""
        beats = Beats(self)
        due = time.monotonic() + self.heartbeat_s
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            lag = max(0.0, time.monotonic() - due)
            due = max(due + self.heartbeat_s, time.monotonic())
            self._load = self.backend.load()
            if await beats.send(self.bus, lag):
                self._beat_sent(beats.last)
            if self.kv is not None and beats.n % 10 == 0:
                log.info("kv_bytes", node=self.node_id, **self.kv.summary())

    def _beat_sent(self, beat: NodeHeartbeat) -> None:
        """A heartbeat is on the stream (on the worker's loop: its counters are the loop's)."""
        self.published += 1
        self.metrics.observe(beat)

    def heartbeat(self, loop_lag_s: float = 0.0, ts: float | None = None) -> NodeHeartbeat:
        """This node's heartbeat: its load (as the loop last read it, from the heartbeat thread),
        and its progress: the stream sequence its view has folded, the events it has published,
        how late its loop is (``loop_lag_s``). ``ts``: the model clock now by default."""
        ld = getattr(self, "_load", None) or self.backend.load()
        return NodeHeartbeat(ts=self.host.clock() if ts is None else ts, src=self.src, node=self.node_id,
                             role=ld.role, running=ld.running, queued=ld.queued,
                             l1_used_tokens=ld.l1_used_tokens, l2_used_tokens=ld.l2_used_tokens,
                             applied_seq=self.applied_seq, published=self.published,
                             loop_lag_s=round(loop_lag_s, 3))


class Beats:
    """Sends heartbeats for a worker and keeps their figures: publish latency (stamp to the
    bus's ack) and the loop's lag, logged as ``heartbeat_stats`` every ``every`` beats (p50,
    p99 and max of each since the last line, the samples themselves in ms, the failures:
    ``evolving soak --trace`` merges them)."""

    def __init__(self, worker, every: int = 10) -> None:
        self.w, self.every = worker, every
        self.n = 0
        self.last: NodeHeartbeat | None = None
        self._pub: list[float] = []
        self._lag: list[float] = []
        self.failed = 0

    async def send(self, bus, loop_lag_s: float) -> bool:
        """Publish one heartbeat; whether the bus took it."""
        w = self.w
        beat = w.heartbeat(loop_lag_s)
        self.last = beat
        msg_id = f"{w.src}:{w._boot}:hb{self.n}"  # ids of their own: not in the events' order
        t0 = time.monotonic()
        try:
            await wait_for(bus.publish(beat, msg_id=msg_id), max(2.0, 2 * w.heartbeat_s))
            ok = True
            self._pub.append(time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a lost heartbeat: the next one follows
            ok = False
            self.failed += 1
            log.warning("heartbeat_failed", node=w.node_id, error=f"{type(exc).__name__}: {exc}",
                        after_s=round(time.monotonic() - t0, 3))
        self._lag.append(loop_lag_s)
        self.n += 1
        if self.n % self.every == 0:
            self.flush()
        return ok

    def flush(self) -> None:
        if not self._lag:
            return
        pub, lag = sorted(self._pub), sorted(self._lag)

        def q(xs: list[float], f: float) -> float | None:
            return round(xs[min(len(xs) - 1, max(0, math.ceil(f * len(xs)) - 1))], 4) if xs else None

        log.info("heartbeat_stats", node=self.w.node_id, beats=len(lag), failed=self.failed,
                 publish_p50_s=q(pub, 0.5), publish_p99_s=q(pub, 0.99), publish_max_s=q(pub, 1.0),
                 loop_lag_p50_s=q(lag, 0.5), loop_lag_p99_s=q(lag, 0.99), loop_lag_max_s=q(lag, 1.0),
                 publish_ms=[round(x * 1e3, 1) for x in self._pub], loop_lag_ms=[round(x * 1e3, 1) for x in self._lag])
        self._pub, self._lag, self.failed = [], [], 0


class HeartbeatThread:
    """The worker's heartbeats from a thread of their own, on an asyncio loop and a bus
    connection of their own (``connect``), so a busy worker still sends them on time: its loop
    folding a burst of KV events, running the node model or waiting for the acks of a backlog
    of publications holds the heartbeat back no more than the GIL's switch interval (5 ms).

    The thread also watches the worker's loop: each beat it posts a probe to it
    (``call_soon_threadsafe``) and reports in ``loop_lag_s`` how long the last probe waited (or,
    while one is still waiting, how long it has waited so far). The liveness watcher reads it
    (services/cores/liveness.py): a node whose heartbeats come but whose loop has stopped is
    not alive. The probe also reads the node's load on the loop (the backend's state is the
    loop's), which the next beat carries. A loop that has not answered for ``stall_log_s`` is
    logged once per stall (``loop_stalled``) with the stack it is stuck in."""

    def __init__(self, worker, connect, loop: asyncio.AbstractEventLoop, stall_log_s: float = 2.0) -> None:
        self.w, self.connect, self.loop = worker, connect, loop
        self.stall_log_s = stall_log_s
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None  # the thread's own: set by stop() to end a wait at once
        self._tloop: asyncio.AbstractEventLoop | None = None  # the thread's loop
        self._posted: float | None = None  # monotonic time of the probe not answered yet
        self._lag = 0.0  # how long the last answered probe waited
        self._logged_stall = False
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{worker.node_id}", daemon=True)
        self._main_ident = threading.get_ident()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """No heartbeat after this returns (unless the thread is stuck past ``timeout_s``): the
        caller publishes the node's removal next."""
        self._stop.set()
        tloop, wake = self._tloop, self._wake
        if tloop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed: the thread has ended
                tloop.call_soon_threadsafe(wake.set)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # on the worker's loop
    def _answer(self, posted: float) -> None:
        self._lag = time.monotonic() - posted
        self._posted = None
        self.w._load = self.w.backend.load()

    def _kv_summary(self) -> None:
        log.info("kv_bytes", node=self.w.node_id, **self.w.kv.summary())

    # on the thread
    def loop_lag(self) -> float:
        """How late the worker's loop is: the wait of the probe still pending, else of the last."""
        posted = self._posted
        return max(self._lag, time.monotonic() - posted) if posted is not None else self._lag

    def _probe(self) -> None:
        if self._posted is None:
            now = time.monotonic()
            self._posted = now
            self._logged_stall = False
            try:
                self.loop.call_soon_threadsafe(self._answer, now)
            except RuntimeError:  # the worker's loop is closed: the worker is gone
                self._stop.set()
        elif not self._logged_stall and time.monotonic() - self._posted > self.stall_log_s:
            self._logged_stall = True
            frame = sys._current_frames().get(self._main_ident)
            where = "".join(traceback.format_stack(frame, limit=8)) if frame is not None else "?"
            log.warning("loop_stalled", node=self.w.node_id, stalled_s=round(time.monotonic() - self._posted, 2),
                        where=where)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # noqa: BLE001 - the thread must say why heartbeats stopped
            log.error("heartbeat_thread_failed", node=self.w.node_id, error=f"{type(exc).__name__}: {exc}")

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` or until :meth:`stop`."""
        with contextlib.suppress(TimeoutError):
            await wait_for(self._wake.wait(), max(0.0, seconds))

    async def _main(self) -> None:
        self._wake, self._tloop = asyncio.Event(), asyncio.get_running_loop()
        bus = None
        while bus is None and not self._stop.is_set():
            try:
                bus = await self.connect()
            except Exception as exc:  # noqa: BLE001 - the bus may be restarting: try again
                log.warning("heartbeat_connect_retry", node=self.w.node_id, error=f"{type(exc).__name__}: {exc}")
                await self._pause(0.5)
        beats = Beats(self.w)
        period = self.w.heartbeat_s
        due = time.monotonic()
        try:
            while not self._stop.is_set():
                due += period
                await self._pause(due - time.monotonic())
                if self._stop.is_set():
                    break
                due = max(due, time.monotonic() - period)  # a late wake-up does not burst beats
                self._probe()
                sent = await beats.send(bus, self.loop_lag())
                with contextlib.suppress(RuntimeError):  # the worker's loop closed: the next check stops
                    if sent:
                        self.loop.call_soon_threadsafe(self.w._beat_sent, beats.last)
                    if self.w.kv is not None and beats.n % 10 == 0:
                        self.loop.call_soon_threadsafe(self._kv_summary)
        finally:
            beats.flush()
            if bus is not None:
                with contextlib.suppress(Exception):
                    await wait_for(bus.close(), 2.0)
