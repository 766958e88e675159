"""``EngineWorker``: one node, an engine backend (engine/backend.py) on the bus. It owns the state
(the worker's view, the queue of publications, the counters), the backend's ``WorkerHost``
callbacks, and start and stop; folding the stream in is engine/worker/stream.py, publishing
out engine/worker/publish.py (engine/worker/__init__.py tells the whole life)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from engine.backend import EngineBackend
from engine.backends.sim.backend import SimBackend
from engine.metrics import EngineMetrics
from engine.profiles import Profile
from engine.transfer import make_transfer
from engine.worker.host import RemotePeer, WallClockHost
from engine.worker.kvgate import KvGate
from engine.worker.prompts import PromptFetch
from engine.worker.publish import Publishing
from engine.worker.stream import StreamFolding
from events.authority import Admission
from events.catalog import Event, FirstToken, NodeRegistered, NodeRemoved, RequestFinished, RequestStarted
from events.ids import NodeId, Role
from events.wire import TokenMsg
from services.adapters.aio import wait_for
from services.adapters.logging import get_logger
from services.adapters.runner import cancel_all
from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import POLICIES
from services.cores.worker_view import WorkerView

if TYPE_CHECKING:  # torch is imported only with --kv-bytes
    from engine.kvplane import KvBytesConfig

log = get_logger("worker")
ROLES = ("collocated", "prefill", "decode")
BACKENDS = ("sim", "sglang", "vllm", "torch")


class EngineWorker(StreamFolding, Publishing):
    """One node: an engine backend, the worker's view of the partition, the bus and the token
    channel. ``backend`` is ``"sim"`` or a factory ``(host, worker) -> EngineBackend``."""

    def __init__(self, bus, tokens, node: str, role: Role, profile: Profile, *, seed: int = 0,
                 time_scale: float = 1.0, fetch_mode: str = "async", eviction: str = "count_aware",
                 heartbeat_s: float = 1.0, token_interval_s: float = 0.2, clock_epoch: float | None = None,
                 epoch: float | None = None, backend: str | Callable = "sim", snapshot_every: int = 2000,
                 kv_bytes: KvBytesConfig | None = None, prompts=None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.bus, self.tokens = bus, tokens
        self.node_id = NodeId(node)
        self.src = node
        self.profile = profile
        self.view = WorkerView()
        self.policy = POLICIES[eviction](profile.block_tokens)
        if epoch is None and clock_epoch is not None:  # the clock every process of a run shares
            epoch = clock_epoch + (time.time() - clock_epoch) * time_scale
        self.host = WallClockHost(time_scale, self._on_emit, self._choose, self._peer, epoch=epoch,
                                  token=self._out_token)
        if backend == "sim":
            self.backend: EngineBackend = SimBackend(self.host, node, role, profile, seed=seed, fetch_mode=fetch_mode)
        elif callable(backend):
            self.backend = backend(self.host, self)
        else:
            raise ValueError(f"backend must be one of {BACKENDS} or a factory, got {backend!r}")
        self.heartbeat_s, self.token_interval_s = heartbeat_s, token_interval_s
        # token ids of the jobs from the prompt store (``prompts``: a PromptStore, None: none)
        self.prompt_fetch = PromptFetch(self, prompts)
        self.snapshot_every = snapshot_every
        self.snapshot_key = f"engine-{node}"
        self._out: asyncio.Queue = asyncio.Queue()
        #: held while a publication is being handed to the bus (the publisher's, or the progress
        #: loop's tokens: publish.py, ``_progress_step``), so the two never interleave out of order
        self._pub_lock = asyncio.Lock()
        self._direct: list[TokenMsg] | None = None  # the progress step's token messages (publish.py)
        self._decode_for: dict[str, str] = {}  # request -> prefill node, for requests we decode
        self._prefill_at: dict[str, str] = {}  # request -> node its prefill started on (stream.py)
        self._first_from: dict[str, str] = {}  # request -> node of its first FirstToken, until it finishes
        self._decoding_here: set[str] = set()  # requests admitted to decode here, until they finish
        self._queued_here: set[str] = set()
        self._cancelled: dict[str, int] = {}  # request cancelled, not held here yet -> tries (cancel.py)
        self._head = 0
        self.applied_seq = 0  # last stream sequence folded into the view
        #: the event authority (events/authority.py) every delivery passes before the view folds it;
        #: its stream time travels in the view's snapshot
        self.admission = Admission()
        self.stream_head = 0  # the stream's last sequence, polled (stream.py, _watch_head)
        self._progress_at = time.monotonic()  # when applied_seq last moved, or the head was reached
        self.consumer_error: str | None = None  # why the stream input last stopped (it restarts)
        self.restored_from = 0  # snapshot position the worker started from (0: folded from 1)
        self._unechoed = 0  # own events published whose echo has not come back yet
        self._since_snap = 0
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.rejoins = 0  # registrations again after the stream said this node was removed
        #: the stream's last word on this node before this start (stream.py): "registered", a
        #: ``NodeRemoved``'s reason, or None (none in the folded tail: a fresh node, or a snapshot)
        self._own_last: str | None = None
        self.live = asyncio.Event()
        self.published = 0
        self.publish_retries = 0  # publications that failed at least once and were tried again
        self._boot = uuid.uuid4().hex[:12]  # message ids of this run: a restart never reuses one
        self._msg_seq = 0
        self.kv = None  # engine.kvplane.KvDataPlane with --kv-bytes
        self.kvgate: KvGate | None = None  # with --kv-bytes on the sim backend
        # a backend that moves its own KV bytes (torch) gives the same hooks: endpoint, peers, summary
        self.kv = getattr(self.backend, "data_plane", None)
        counts = getattr(self.backend, "cached_vs_server", None)
        self.metrics = EngineMetrics(node, self.backend.load, self._kv_blocks,
                                     getattr(self.backend, "kv_event_counts", None),
                                     (lambda: dict(counts)) if counts is not None else None)
        self._cached: dict[str, int] = {}  # request -> cached prompt tokens, until its "first" token message
        if kv_bytes is not None:
            if self.backend.name != "sim":
                raise ValueError("--kv-bytes runs with the sim backend (SGLang moves its own KV)")
            from engine.kvplane import KvDataPlane  # lazy: optional dependency (torch; --kv-bytes only)

            transfer = make_transfer(kv_bytes.transfer, node=node, host=kv_bytes.host, fabric=kv_bytes.fabric)
            self.kv = KvDataPlane(node, profile.block_tokens, profile.l1_capacity_tokens // profile.block_tokens,
                                  profile.l2_capacity_tokens // profile.block_tokens, kv_bytes, transfer)
            # a job waits for its fetched bytes; refused ones are recomputed (engine/worker/kvgate.py)
            self.kvgate = KvGate(self)
            self.kv.on_landed = self.kvgate.landed

    # ------------------------------------------------------------------ view
    @property
    def directory(self) -> DirectoryCore:
        return self.view.directory

    @property
    def node(self):
        """The sim node model (tests and the sim backend only)."""
        return getattr(self.backend, "node", None)

    # ------------------------------------------------------------------ WorkerHost callbacks
    def _kv_blocks(self, tier: str) -> int:
        return len(self.directory.copies(self.node_id, tier)) if self.node_id in self.directory.nodes() else 0

    def _on_emit(self, event: Event) -> None:
        if self.kv is not None:
            self.kv.observe(event)  # bytes follow the fact before peers learn of it
            if self.kvgate is not None:
                self.kvgate.emitted(event)
        t = type(event)
        if t is RequestStarted and event.phase == "prefill" and event.node == self.node_id:
            self._cached[event.request] = event.cached_tokens
            req = self.view.requests.get(event.request)
            self.metrics.observe(event, req.prompt_tokens if req is not None else 0)
        else:
            if t is RequestFinished:
                self._cached.pop(event.request, None)
            self.metrics.observe(event)
        self.view.apply(event)
        self._unechoed += 1
        self._out.put_nowait(event)
        if type(event) is FirstToken:
            self._queued_here.discard(event.request)  # prefill done: no longer movable by a reroute

    def _out_token(self, msg: TokenMsg) -> None:
        if msg.kind == "first":
            cached = self._cached.pop(msg.request, None)
            if cached is not None:
                msg = msgspec.structs.replace(msg, cached_tokens=cached)
        direct = self._direct
        if direct is not None and self._out.empty():  # nothing emitted before it waits: the progress loop sends it
            direct.append(msg)
        else:
            self._out.put_nowait(msg)

    def _choose(self, node, tier, tokens, pinned):
        return self.policy.choose(self.directory, node, tier, tokens, pinned)

    def _peer(self, node):
        if node == self.node_id:
            return self.backend
        return RemotePeer(node, self.directory)

    def _publish_own(self, event: Event) -> None:
        self.metrics.observe(event)
        self.view.apply(event)
        self._unechoed += 1
        self._out.put_nowait(event)

    async def _progress(self) -> None:
        await progress_loop(self.backend, self.host, self.token_interval_s, self._progress_step)

    #: behind the stream's head with no sequence folded for this long: the stream input is stuck
    STUCK_AFTER_S = 5.0

    def stream_state(self) -> dict:
        """How the stream input stands: its lag behind the head, how long it has not moved while
        behind, and whether that makes it stuck (``STUCK_AFTER_S``)."""
        lag = max(0, self.stream_head - self.applied_seq)
        idle = 0.0 if lag == 0 else time.monotonic() - self._progress_at
        stuck = lag > 0 and idle > self.STUCK_AFTER_S
        return {"applied_seq": self.applied_seq, "head": self.stream_head, "lag": lag,
                "stalled_s": round(idle, 1), "stuck": stuck, "consumer_error": self.consumer_error,
                "refused": self.admission.refused}

    def health(self) -> dict:
        """``/healthz``: ready (200) once registered and serving with its stream input keeping up,
        else 503: a worker whose view is stuck behind the stream (it would never see its routes)
        is not ready, and says why."""
        st = self.stream_state()
        ready = self.live.is_set() and not st["stuck"]
        out = {"ready": ready, "node": self.node_id, "role": self.backend.role,
               "backend": self.backend.name, "published": self.published,
               "publish_retries": self.publish_retries, **st}
        if self.live.is_set() and st["stuck"]:
            out["why"] = (f"the stream input is stuck at sequence {st['applied_seq']}, {st['lag']} behind the head "
                          f"for {st['stalled_s']} s" + (f" ({self.consumer_error})" if self.consumer_error else ""))
        return out

    def registration(self) -> NodeRegistered:
        p = self.profile
        # a backend attached to a server registers the server's own capacity once it has read it (vLLM)
        l1, l2 = getattr(self.backend, "kv_capacity_tokens", None) or (p.l1_capacity_tokens, p.l2_capacity_tokens)
        return NodeRegistered(ts=self.host.catch_up(), src=self.src, node=self.node_id, role=self.backend.role,
                              gpus=p.gpus_per_node, l1_capacity_tokens=l1, l2_capacity_tokens=l2,
                              prefill_token_budget=p.prefill_token_budget, max_running_requests=p.max_running,
                              t_fwd=p.t_fwd, profile=p.name,
                              transfer_endpoint=self.kv.endpoint if self.kv is not None else "")

    async def start(self) -> None:
        """Start the backend, restore snapshot + tail, register, and start serving."""
        await self.backend.start()
        if self.kv is not None:
            await self.kv.start()
        await self.load_snapshot()
        self._head = await self.bus.last_seq()
        caught_up = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._publisher(), name="publisher"))
        self._tasks.append(asyncio.create_task(self._consume(caught_up), name="consumer"))
        await caught_up.wait()
        if self.node_id in self.directory.nodes() or self._own_last not in (None, "registered", "restarted", "shutdown"):
            # a previous run of this node did not say its KV and its requests are gone: say it now.
            # Also when the liveness watcher removed it for silence meanwhile (a restart slower
            # than the heartbeat timeout): that removal alone lets the watcher wait for the node
            # to come back and finish its decodes, which died with the old process (they hung)
            self._publish_own(NodeRemoved(ts=self.host.catch_up(), src=self.src, node=self.node_id,
                                          reason="restarted"))
        self._publish_own(self.registration())
        self._tasks.append(asyncio.create_task(self.host.run(), name="node"))
        self._tasks.append(asyncio.create_task(self._progress(), name="progress"))
        await self._out.join()
        # heartbeats bypass the queue (a thread and a connection of their own with heartbeat_bus):
        # start them once the registration is on the stream
        self._start_heartbeats()
        self.live.set()
        log.info("worker_up", node=self.node_id, role=self.backend.role, backend=self.backend.name,
                 profile=self.profile.name, restored_from=self.restored_from, head=self._head,
                 time_scale=self.host.scale)

    async def stop(self, reason: str = "shutdown") -> None:
        """Publish ``NodeRemoved``, flush everything queued, snapshot, cancel the tasks."""
        self._stopping = True  # a removal seen from now on is not answered by registering again
        self._stop_heartbeats()  # none after the NodeRemoved below
        for t in self._tasks[2:]:
            t.cancel()
        self._publish_own(NodeRemoved(ts=self.host.catch_up(), src=self.src, node=self.node_id, reason=reason))
        with contextlib.suppress(asyncio.TimeoutError):
            await wait_for(self._out.join(), 10.0)
        for _ in range(100):  # let the echoes come back, so the snapshot is consistent
            if not self._unechoed:
                break
            await asyncio.sleep(0.02)
        with contextlib.suppress(asyncio.TimeoutError):  # a lost snapshot only lengthens the next start
            await wait_for(self.snapshot(), 10.0)
        if self.kv is not None:
            await self.kv.drain()
            summary = self.kv.summary()
            (log.error if summary["failed"] else log.info)("kv_bytes_summary", node=self.node_id, **summary)
            await self.kv.close()
        # bounded: nats-py swallows a cancellation that lands inside a publish, and the publisher
        # task then waits on its queue for good (two workers of `evolving chaos --engines` never
        # exited on SIGTERM, each killed after 30 s, mid-publication of a backlog)
        await cancel_all(self._tasks)
        self._tasks.clear()
        with contextlib.suppress(Exception):
            await self.backend.close()
        log.info("worker_stopped", node=self.node_id, reason=reason)


#: with no run to pace, the progress loop wakes at least this often even if no schedule came
#: (a safety net only: a run starts in a callback that schedules its end). Not ``interval_s``
#: (0.2 s): five idle wake-ups a second, each a ``wait_for`` task, on each engine
IDLE_WAKE_S = 1.0
#: the shortest wait between two ``progress()`` calls: a sim run at a large time scale has
#: iterations of microseconds of wall time; past 500 calls a second they are batched into chunks
MIN_PROGRESS_S = 0.002


def progress_wait_s(backend, interval_s: float) -> float | None:
    """How long the worker waits before its next ``backend.progress()``: ``interval_s``
    (``--token-interval-s``), or less when the backend says when its next iteration ends
    (``next_progress_s()``, the sim engine's: one chunk per iteration), never under
    :data:`MIN_PROGRESS_S`. ``None``: the backend paces its output and has no run now, so the
    loop waits for the host's next ``schedule`` (a run starts in a callback that schedules its
    end) for at most :data:`IDLE_WAKE_S`, instead of asking again every few ms (polling at 50 Hz cost
    each idle engine several ms of CPU a second)."""
    nxt = getattr(backend, "next_progress_s", None)  # optional: only backends that pace their output
    if nxt is None:
        return interval_s
    due = nxt()
    if due is None:
        return None
    return max(MIN_PROGRESS_S, min(interval_s, due + 1e-4))


async def progress_loop(backend, host: WallClockHost, interval_s: float, step=None) -> None:
    """The worker's token pacing, for its whole life: ``backend.progress()`` after each wait of
    :func:`progress_wait_s`; with no run to pace, until the host schedules something (a run
    starts in a callback that schedules its end) or :data:`IDLE_WAKE_S` has passed. ``step``:
    ``async step(progress)`` calls it instead (the worker's ``_progress_step``, which sends the
    iteration's token messages itself)."""
    while True:
        wait = progress_wait_s(backend, interval_s)
        if wait is None:
            host.scheduled.clear()
            with contextlib.suppress(TimeoutError):
                await wait_for(host.scheduled.wait(), max(interval_s, IDLE_WAKE_S))
        else:
            await asyncio.sleep(wait)
        host.catch_up()
        if step is None:
            backend.progress()
        else:
            await step(backend.progress)
