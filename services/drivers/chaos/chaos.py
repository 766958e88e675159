"""``evolving chaos``: the fault suite as a command, over a live stack under load.

It starts its own stack on loopback - a 3-server NATS cluster (services.adapters.bus.natsserver.NatsCluster)
with the partition's stream replicated on all three (R3), the directory, planner, router and
recorder services as child processes (services.drivers.up.testing.spawn_service), and a load
generator publishing harness traffic for 2 prefill + 2 decode nodes (registrations, heartbeats,
agent branches and requests), every event with a message id and retried with the same id when
a publish fails - then injects one fault after another while the load runs:

==========================  ====================================================================
scenario                    fault
==========================  ====================================================================
kill-<service>              SIGKILL the service (no final ack, no final snapshot), start it again
kill-nats-leader            SIGKILL the nats-server leading the stream (one of three); it comes
                            back once the stack has recovered
corrupt-<kind>-snapshot     SIGKILL the service, flip one bit of its snapshot in the object
                            store, start it again: the snapshot must be rejected, the state
                            rebuilt from sequence 0
partition-engine            node d1 stops heartbeating; the planner must remove it (NodeRemoved)
duplicate-publish           republish the last 50 harness events with their message ids
rewind-consumer             delete the router's durable consumer and re-create it 100
                            sequences behind its ack floor while the router runs
malformed-events            garbage bytes, an event of a newer major schema, a request with a
                            negative block hash: each must land in the dead-letter stream of
                            every consumer while the services go on
==========================  ====================================================================

For each scenario the table says: survived (no unplanned exit, recovered, the scenario's own
check holds), events lost (harness ids acknowledged by the bus but absent from the stream,
requests never decided, stream events absent from the recorder's DuckDB log), events
duplicated (harness ids stored twice, requests decided more than once), decisions diverged
(``verify_log`` of the recorder's DuckDB file, divergences attributed to the scenario whose
window holds their sequence) and the time to recover (seconds from the fault until every
service has folded past the stream head seen at the fault and a request published after the
fault is decided). docs/chaos.md has the long form and measured figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from events import codec
from events.catalog import BranchOpened, Event, NodeHeartbeat, NodeRegistered, NodeRemoved, RequestSubmitted
from events.subjects import subject_for
from services.adapters.bus.nats_bus import MSG_ID, Delivery, NatsBus, StreamSettings
from services.adapters.bus.natsserver import NatsCluster
from services.adapters.logging import get_logger
from services.drivers.up.testing import REPO, acting_route_counts, spawn_service

log = get_logger("chaos")

SERVICES = ("directory", "planner", "router", "recorder")
SNAPSHOT_KINDS = ("directory", "planner", "router")
R3 = StreamSettings(replicas=3)
LOAD_SRC = "harness"
NODES = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
PARTITIONED = "d1"
#: the planner's clock shrunk to the suite's length: it refits every second, ends warm-up after
#: 4 s and evaluates a 4 s window from then on, so its decisions (ModelFitted, PlanEvaluated)
#: are on the stream for verify to check, not only the router's
PLANNER_ARGS = ("warmup_s=4", "fit_interval_s=1", "window_s=4", "slices=4", "cooldown_s=4")


# ============================================================================ results
@dataclass
class ScenarioResult:
    name: str
    fault: str
    survived: bool = False
    lost: int = 0
    duplicated: int = 0
    diverged: int = 0
    recover_s: float | None = None
    detail: str = ""
    #: the numbers behind lost/duplicated (which kind of loss or duplicate)
    counts: dict[str, int] = field(default_factory=dict)
    window: tuple[int, int] = (0, 0)  # stream sequences (first, last] of the scenario
    published: tuple[int, int] = (0, 0)  # index range of the load generator's publications

    @property
    def all_zero(self) -> bool:
        return self.survived and not (self.lost or self.duplicated or self.diverged)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recover_s"] = None if self.recover_s is None else round(self.recover_s, 2)
        d["window"], d["published"] = list(self.window), list(self.published)
        return d


@dataclass
class Published:
    msg_id: str
    event: Event
    seq: int
    t: float  # monotonic time the bus acknowledged it


# ============================================================================ the stream, read as it grows
class Tail:
    """The harness's own copy of the stream, read from a cursor every ``every_s`` (an ephemeral
    consumer per read, so a killed server only costs one retried read)."""

    def __init__(self, bus: NatsBus, every_s: float = 0.2) -> None:
        self.bus, self.every_s = bus, every_s
        self.deliveries: list[Delivery] = []
        self.seen_at: dict[int, float] = {}  # seq -> monotonic time first read
        self.cursor = 0  # every sequence up to here is read (or undecodable)
        self.errors = 0
        self.undecodable: set[int] = set()

        async def count_only(consumer, seq, subject, data, reason) -> None:
            bus.dead_lettered += 1  # the services' consumers dead-letter it; the harness only reads
            self.undecodable.add(seq)

        bus._dead_letter = count_only

    async def poll(self, idle_s: float = 0.3) -> None:
        head = await asyncio.wait_for(self.bus.last_seq(), 5)
        if head <= self.cursor:
            return
        got: set[int] = set()
        async with self.bus.consumer(None, start_seq=self.cursor + 1) as c:
            it = c.__aiter__()
            while max(got, default=self.cursor) < head:
                try:
                    d = await asyncio.wait_for(it.__anext__(), timeout=idle_s)
                except (TimeoutError, StopAsyncIteration):
                    break
                got.add(d.seq)
                if d.seq not in self.seen_at:  # read again after a gap: keep the first copy
                    self.deliveries.append(d)
                    self.seen_at[d.seq] = time.monotonic()
        # the cursor moves over what was read and what the consumer skipped as undecodable, and
        # stops at the first gap (a message not delivered yet is read again next time)
        while self.cursor + 1 in got or self.cursor + 1 in self.undecodable:
            self.cursor += 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self.poll(), 30)
            except Exception as exc:  # noqa: BLE001 - a server lost mid-read: read again
                self.errors += 1
                log.debug("tail_retry", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)

    def first_decision_after(self, published: list[Published], t: float) -> float | None:
        """Monotonic time the first acting ``RouteDecided`` of a request published after ``t``
        was read, or None."""
        after = {p.event.request for p in published if p.t >= t and isinstance(p.event, RequestSubmitted)}
        if not after:
            return None
        for d in self.deliveries:
            ev = d.event
            if type(ev).__name__ == "RouteDecided" and not ev.shadow and not ev.reroute and ev.request in after:
                return self.seen_at[d.seq]
        return None


# ============================================================================ load generator
class Load:
    """Harness traffic for 2 prefill + 2 decode nodes: registrations, heartbeats every
    ``heartbeat_s`` (except for silenced nodes), and ``rate`` requests/s in agent branches whose
    prompts grow (each request extends its branch's context). Every event carries a message id
    and a failed publish is retried with the same id, as an engine does."""

    def __init__(self, bus: NatsBus, rate: float = 20.0, heartbeat_s: float = 0.5,
                 branch_len: int = 6, blocks_per_request: int = 4, retry_for_s: float = 60.0) -> None:
        self.bus, self.rate, self.heartbeat_s = bus, rate, heartbeat_s
        self.branch_len, self.bpr, self.retry_for_s = branch_len, blocks_per_request, retry_for_s
        self.published: list[Published] = []
        self.silent: set[str] = set()
        self.nodes = NODES  # () when sim engine workers register and heartbeat themselves
        self.tail: Tail | None = None  # set by the stack: where the generator sees NodeRemoved
        self.rejoins: list[str] = []  # nodes registered again after an unintended removal
        self._registered_at: dict[str, int] = {}  # node -> stream seq of its last NodeRegistered
        self._scan = 0
        self.retries = 0
        self._n = 0
        self._branch = -1
        self._k = branch_len

    async def publish(self, ev: Event, msg_id: str | None = None) -> Published:
        mid = msg_id or f"load:{self._n}"
        self._n += 1
        deadline = time.monotonic() + self.retry_for_s
        while True:
            try:
                seq = await asyncio.wait_for(self.bus.publish(ev, msg_id=mid), 5)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                self.retries += 1
                await asyncio.sleep(0.2)
        p = Published(mid, ev, seq, time.monotonic())
        self.published.append(p)
        return p

    async def register(self, node: str, role: str) -> None:
        p = await self.publish(NodeRegistered(ts=time.time(), src=LOAD_SRC, node=node, role=role,
                                              l1_capacity_tokens=1 << 22, l2_capacity_tokens=1 << 24))
        self._registered_at[node] = p.seq

    async def rejoin_removed(self) -> None:
        """A node removed while it was not silenced (a stall of the harness itself, or a bus
        outage longer than the heartbeat timeout) registers again, as an engine that learns of
        its own removal should (docs/chaos.md: the sim worker does not yet)."""
        if self.tail is None:
            return
        new, self._scan = self.tail.deliveries[self._scan:], len(self.tail.deliveries)
        roles = dict(self.nodes)
        for d in new:
            ev = d.event
            if (isinstance(ev, NodeRemoved) and ev.node in roles and ev.node not in self.silent
                    and d.seq > self._registered_at.get(ev.node, 0)):
                self.rejoins.append(ev.node)
                await self.register(ev.node, roles[ev.node])

    async def next_request(self) -> None:
        if self._k >= self.branch_len:
            self._branch += 1
            self._k = 0
            await self.publish(BranchOpened(ts=time.time(), src=LOAD_SRC, branch=f"c{self._branch}",
                                            session=f"c{self._branch}"))
        bid, k = f"c{self._branch}", self._k
        base = (self._branch + 1) * 1_000_003
        blocks = [base * 131 + j for j in range((k + 1) * self.bpr)]
        await self.publish(RequestSubmitted(ts=time.time(), src=LOAD_SRC, request=f"{bid}/{k}", branch=bid,
                                            blocks=blocks, prompt_tokens=len(blocks) * 64 + 10, max_tokens=16))
        self._k += 1

    async def run(self, stop: asyncio.Event) -> None:
        for node, role in self.nodes:
            await self.register(node, role)
        loop = asyncio.get_running_loop()
        next_req = next_hb = loop.time()
        while not stop.is_set():
            now = loop.time()
            if now >= next_hb:
                await self.rejoin_removed()
                for node, role in self.nodes:
                    if node not in self.silent:
                        await self.publish(NodeHeartbeat(ts=time.time(), src=LOAD_SRC, node=node, role=role))
                next_hb = max(next_hb + self.heartbeat_s, now)
            if now >= next_req:
                await self.next_request()
                next_req = max(next_req + 1.0 / self.rate, now - 1.0)  # after a stall: no burst
            wait = max(0.0, min(next_req, next_hb) - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    def requests(self, lo: int = 0, hi: int | None = None) -> list[str]:
        return [p.event.request for p in self.published[lo:hi] if isinstance(p.event, RequestSubmitted)]


# ============================================================================ the stack
async def connect_when_ready(url: str, partition: str, timeout_s: float = 30.0) -> NatsBus:
    """A fresh cluster answers before it has a JetStream leader: retry the stream setup."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await asyncio.wait_for(NatsBus.connect(url, partition, settings=R3, name="evolving-chaos"), 10)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


class Stack:
    """The cluster, the four services as child processes, the load and the tail."""

    def __init__(self, workdir: Path, *, partition: str = "chaos", rate: float = 20.0,
                 heartbeat_s: float = 0.5, heartbeat_timeout_s: float = 2.0, tick_s: float = 0.5,
                 engines: bool = False) -> None:
        self.workdir, self.partition, self.engines = workdir, partition, engines
        self.engine_procs: dict[str, subprocess.Popen] = {}
        self.rate, self.heartbeat_s = rate, heartbeat_s
        self.heartbeat_timeout_s, self.tick_s = heartbeat_timeout_s, tick_s
        self.db = workdir / "chaos.duckdb"
        self.cluster: NatsCluster | None = None
        self.bus: NatsBus | None = None
        self.tail_bus: NatsBus | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        #: each service's /metrics port, read from its ``metrics_listening`` log line (it binds
        #: port 0: a port picked here and bound later could be taken meanwhile)
        self.ports: dict[str, int | None] = dict.fromkeys(SERVICES)
        self._spawned_at: dict[str, int] = {}
        self.logs = {k: workdir / f"{k}.log" for k in SERVICES}
        self.unplanned: list[str] = []  # "router exited 1" for every exit no scenario asked for
        self.load: Load | None = None
        self.tail: Tail | None = None
        self._stop_load = asyncio.Event()
        self._stop_tail = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._http = None

    # ------------------------------------------------------------------ processes
    def spawn(self, kind: str) -> subprocess.Popen:
        self.ports[kind] = None
        self._spawned_at[kind] = self.log_size(kind)
        extra = ["--metrics-port", "0", "--snapshot-every", "50", "--snapshot-interval-s", "1",
                 "--stream-replicas", "3"]
        if kind == "planner":
            extra += ["--tick-s", str(self.tick_s), "--heartbeat-timeout-s", str(self.heartbeat_timeout_s)]
            for kv in PLANNER_ARGS:
                extra += ["--planner-arg", kv]
        if kind == "recorder":
            extra += ["--db", str(self.db), "--flush-interval-s", "0.1"]
        proc = spawn_service(kind, self.cluster.url, self.partition, *extra, env={"EI_LOG_FORMAT": "json"},
                             log_path=self.logs[kind])
        self.procs[kind] = proc
        return proc

    def spawn_engine(self, node: str, role: str) -> subprocess.Popen:
        """A sim engine worker for ``node`` (``python -m engine.worker``)."""
        cmd = [sys.executable, "-m", "engine.worker", "--node", node, "--role", role, "--nats-url", self.cluster.url,
               "--partition", self.partition, "--stream-replicas", "3", "--heartbeat-s", str(self.heartbeat_s),
               "--seed", str(len(self.engine_procs)), "--log-format", "json"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.workdir / f"engine-{node}.log", "ab") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.engine_procs[node] = proc
        return proc

    def kill(self, kind: str) -> None:
        proc = self.procs.get(kind)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def supervise(self) -> None:
        """Restart a service that exited without being asked to (and remember it: the scenario
        in progress did not survive)."""
        for kind, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is not None:
                self.unplanned.append(f"{kind} exited {rc}")
                log.warning("service_exited", service=kind, rc=rc)
                self.spawn(kind)
        for node, proc in list(self.engine_procs.items()):
            rc = proc.poll()
            if rc is not None:
                self.unplanned.append(f"engine {node} exited {rc}")
                log.warning("engine_exited", node=node, rc=rc)
                self.spawn_engine(node, dict(NODES)[node])

    def log_events(self, kind: str, offset: int = 0) -> list[dict]:
        """The JSON log records a service wrote after byte ``offset`` of its log."""
        out = []
        with open(self.logs[kind], "rb") as f:
            f.seek(offset)
            for line in f.read().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if isinstance(rec, dict):
                        out.append(rec)
        return out

    def log_size(self, kind: str) -> int:
        return self.logs[kind].stat().st_size if self.logs[kind].exists() else 0

    async def health(self, kind: str) -> dict | None:
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        if self.ports[kind] is None:
            for rec in self.log_events(kind, self._spawned_at.get(kind, 0)):
                if rec.get("event") == "metrics_listening":
                    self.ports[kind] = int(rec["url"].rsplit(":", 1)[1].split("/", 1)[0])
            if self.ports[kind] is None:
                return None  # not listening yet
        try:
            async with self._http.get(f"http://127.0.0.1:{self.ports[kind]}/healthz") as r:
                return await r.json()
        except Exception:  # noqa: BLE001 - not up (yet): the caller polls again
            return None

    async def caught_up(self, head: int, kinds=SERVICES) -> bool:
        for kind in kinds:
            h = await self.health(kind)
            if not h or not h.get("ready") or h.get("applied_seq", 0) < head:
                return False
        return True

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.cluster = NatsCluster(3, name="chaos")
        await asyncio.to_thread(self.cluster.start)
        self.bus = await connect_when_ready(self.cluster.url, self.partition)
        for kind in SERVICES:
            self.spawn(kind)
        await self.wait(lambda: self.caught_up(0), 60, "the services to start")
        self.load = Load(self.bus, rate=self.rate, heartbeat_s=self.heartbeat_s)
        if self.engines:
            self.load.nodes = ()
            for node, role in NODES:
                self.spawn_engine(node, role)
        self.tail_bus = await connect_when_ready(self.cluster.url, self.partition)
        self.tail = Tail(self.tail_bus)
        self.load.tail = self.tail
        self._tasks = [asyncio.create_task(self.load.run(self._stop_load), name="chaos-load"),
                       asyncio.create_task(self.tail.run(self._stop_tail), name="chaos-tail")]
        await self.wait(lambda: self._decided_since(0.0), 30, "a first decision")

    async def _decided_since(self, t: float) -> bool:
        return self.tail.first_decision_after(self.load.published, t) is not None

    async def wait(self, pred: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                   every_s: float = 0.1) -> float:
        """Poll ``pred`` (supervising the services meanwhile); the monotonic time it held."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.supervise()
            if self._tasks and self._tasks[0].done():
                self._tasks[0].result()  # the load generator failed: say why
            try:  # a check that hangs (a reply lost with a killed server) is a "not yet"
                ok = await asyncio.wait_for(pred(), 15)
            except TimeoutError:
                ok = False
            if ok:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
            await asyncio.sleep(every_s)

    async def stop_load(self) -> None:
        self._stop_load.set()
        if self._tasks:
            await asyncio.wait_for(self._tasks[0], 60)

    async def stop_services(self) -> dict[str, int | None]:
        """SIGTERM every service (the recorder drains to the head) and wait."""
        rcs: dict[str, int | None] = {}
        for node, proc in self.engine_procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rcs[f"engine-{node}"] = await asyncio.wait_for(asyncio.to_thread(proc.wait), 30)
            except TimeoutError:
                proc.kill()
                rcs[f"engine-{node}"] = None
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for kind, proc in self.procs.items():
            try:
                rcs[kind] = await asyncio.wait_for(asyncio.to_thread(proc.wait), 30)
            except TimeoutError:
                proc.kill()
                rcs[kind] = None
        return rcs

    async def close(self) -> None:
        """Stop everything that is still running (idempotent; called from ``finally``)."""
        self._stop_load.set()
        self._stop_tail.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(t, 5)
        for kind in list(self.procs):
            self.kill(kind)
        for proc in self.engine_procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped worker cannot die of SIGKILL's cleanup
                proc.kill()
                proc.wait()
        if self._http is not None:
            await self._http.close()
        for bus in (self.tail_bus, self.bus):
            if bus is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(bus.close(), 5)
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)


# ============================================================================ scenarios
@dataclass
class Scenario:
    name: str
    fault: str
    run: Callable[[Stack, ScenarioResult], Awaitable[None]]
    quick: bool = False


async def _recover(stack: Stack, t_fault: float, head: int, timeout_s: float = 45.0) -> float:
    """Seconds from ``t_fault`` until every service folded past ``head`` and a request
    published after the fault is decided."""

    async def done() -> bool:
        return await stack.caught_up(head) and await stack._decided_since(t_fault)

    t = await stack.wait(done, timeout_s, "recovery")
    return t - t_fault


def kill_service(kind: str) -> Callable[[Stack, ScenarioResult], Awaitable[None]]:
    async def run(stack: Stack, res: ScenarioResult) -> None:
        head = await stack.bus.last_seq()
        t = time.monotonic()
        stack.kill(kind)
        stack.spawn(kind)
        res.recover_s = await _recover(stack, t, head)
        res.survived = True
    return run


def corrupt_snapshot(kind: str) -> Callable[[Stack, ScenarioResult], Awaitable[None]]:
    async def run(stack: Stack, res: ScenarioResult) -> None:
        async def present() -> bool:
            return await stack.bus.get_snapshot(kind) is not None

        await stack.wait(present, 20, f"a {kind} snapshot")
        head = await stack.bus.last_seq()
        t = time.monotonic()
        stack.kill(kind)
        data = bytearray(await stack.bus.get_snapshot(kind))
        data[len(data) // 2] ^= 0x04  # one bit, in the middle of the sealed body
        await asyncio.wait_for(stack.bus.put_snapshot(kind, bytes(data)), 30)
        offset = stack.log_size(kind)
        stack.spawn(kind)
        res.recover_s = await _recover(stack, t, head)
        recs = stack.log_events(kind, offset)
        rejected = [r for r in recs if r.get("event") == "snapshot_rejected"]
        starts = [r for r in recs if r.get("event") == "service_start"]
        rebuilt = bool(starts) and starts[0].get("from_snapshot") == 0
        res.survived = bool(rejected) and rebuilt
        res.detail = (f"rejected: {rejected[0].get('reason')}; rebuilt from 0" if res.survived
                      else f"snapshot_rejected logged: {bool(rejected)}, rebuilt from 0: {rebuilt}")
    return run


async def kill_nats_leader(stack: Stack, res: ScenarioResult) -> None:
    info = await stack.bus.js.stream_info(stack.bus.stream)
    leader = info.cluster.leader if info.cluster else None
    names = [s.server_name for s in stack.cluster.servers]
    i = names.index(leader) if leader in names else 0
    head = await stack.bus.last_seq()
    t = time.monotonic()
    stack.cluster.kill(i)
    try:
        res.recover_s = await _recover(stack, t, head)
    finally:
        await asyncio.to_thread(stack.cluster.restart, i)

    async def rejoined() -> bool:
        try:
            inf = await asyncio.wait_for(stack.bus.js.stream_info(stack.bus.stream), 3)
        except Exception:  # noqa: BLE001 - still electing
            return False
        reps = (inf.cluster.replicas or []) if inf.cluster else []
        return inf.config.num_replicas == 3 and len(reps) == 2 and all(r.current for r in reps)

    await stack.wait(rejoined, 30, f"{names[i]} to rejoin the stream")
    res.survived = True
    res.detail = f"killed {names[i]} (the stream leader); stream still R3, all replicas current"


async def partition_engine(stack: Stack, res: ScenarioResult) -> None:
    worker = stack.engine_procs.get(PARTITIONED)
    if worker is not None:
        worker.send_signal(signal.SIGSTOP)  # the whole process stops: no heartbeat, no work
    else:
        stack.load.silent.add(PARTITIONED)
    t = time.monotonic()
    start = len(stack.tail.deliveries)

    async def removed() -> bool:
        return any(isinstance(d.event, NodeRemoved) and d.event.node == PARTITIONED
                   for d in stack.tail.deliveries[start:])

    try:
        t_seen = await stack.wait(removed, stack.heartbeat_timeout_s + 15, f"NodeRemoved({PARTITIONED})")
        res.recover_s = t_seen - t
        await asyncio.sleep(0.5)  # a few more ticks: removed once, not once per tick
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGCONT)
        else:
            stack.load.silent.discard(PARTITIONED)
            await stack.load.register(PARTITIONED, "decode")
    removals = [d for d in stack.tail.deliveries[start:]
                if isinstance(d.event, NodeRemoved) and d.event.node == PARTITIONED]
    res.survived = len(removals) == 1
    res.detail = (f"{PARTITIONED} removed after {res.recover_s:.1f} s of silence "
                  f"(timeout {stack.heartbeat_timeout_s:g} s), {len(removals)} NodeRemoved")
    if worker is None:
        res.detail += "; re-registered"
        return
    after = len(stack.tail.deliveries)

    async def rejoined() -> bool:
        return any(isinstance(d.event, NodeRegistered) and d.event.node == PARTITIONED
                   for d in stack.tail.deliveries[after:])

    try:
        await stack.wait(rejoined, 10, f"{PARTITIONED} to register again")
        res.detail += "; the worker registered again after SIGCONT"
    except TimeoutError:
        res.detail += "; after SIGCONT the worker did not register again within 10 s (left out of routing)"



async def duplicate_publish(stack: Stack, res: ScenarioResult, window: int = 50) -> None:
    recent = stack.load.published[-window:]
    head = await stack.bus.last_seq()
    t = time.monotonic()
    seqs = await stack.bus.publish_many([p.event for p in recent], msg_ids=[p.msg_id for p in recent])
    same = sum(s == p.seq for s, p in zip(seqs, recent, strict=True))
    res.recover_s = await _recover(stack, t, head)
    res.survived = same == len(recent)
    res.detail = f"{len(recent)} republished with their ids: {same} answered with the original sequence"


async def rewind_consumer(stack: Stack, res: ScenarioResult, behind: int = 100) -> None:
    from nats.js import api

    js, stream = stack.bus.js, stack.bus.stream
    info = await js.consumer_info(stream, "router")
    floor = info.ack_floor.stream_seq if info.ack_floor else 0
    start = max(1, floor - behind)
    head = await stack.bus.last_seq()
    t = time.monotonic()
    await js.delete_consumer(stream, "router")
    cfg = info.config
    await js.add_consumer(stream, config=api.ConsumerConfig(
        durable_name="router", ack_policy=api.AckPolicy.ALL, max_ack_pending=cfg.max_ack_pending,
        ack_wait=cfg.ack_wait, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
        filter_subject=cfg.filter_subject, max_waiting=cfg.max_waiting))
    res.recover_s = await _recover(stack, t, head)
    res.survived = True
    res.detail = f"router's durable re-created at {start} (ack floor {floor}) while it ran"


def _negative_block_request() -> bytes:
    """A ``RequestSubmitted`` whose block hash is -1: valid msgpack, outside ``[0, 2**64)``."""
    ev = RequestSubmitted(ts=time.time(), src=LOAD_SRC, request="bad/neg", branch="bad", blocks=[7, 8],
                          prompt_tokens=138, max_tokens=16)
    raw = msgspec.msgpack.decode(codec.encode(ev))

    def swap(x):
        if isinstance(x, list) and x == [7, 8]:
            return [7, -1]
        if isinstance(x, list):
            return [swap(v) for v in x]
        if isinstance(x, dict):
            return {k: swap(v) for k, v in x.items()}
        return x

    return msgspec.msgpack.encode(swap(raw))


async def malformed_events(stack: Stack, res: ScenarioResult) -> None:
    bus = stack.bus
    good = RequestSubmitted(ts=time.time(), src=LOAD_SRC, request="bad/x", branch="bad", blocks=[1],
                            prompt_tokens=74, max_tokens=16)
    subject = subject_for(good, bus.partition)
    newer = str(int(codec.SCHEMA_VERSION.split(".")[0]) + 1) + ".0"
    bad = [("garbage", b"\xc1\x00garbage\xff" * 4, codec.headers()),
           ("newer-major-schema", codec.encode(good), {codec.SCHEMA_HEADER: newer}),
           ("negative-block-hash", _negative_block_request(), codec.headers())]
    t = time.monotonic()
    seqs = {}
    for i, (what, data, hdrs) in enumerate(bad):
        seqs[what] = await bus.publish_raw(subject, data, hdrs, msg_id=f"chaos:bad:{i}")
    res.recover_s = await _recover(stack, t, max(seqs.values()))
    wanted = {(c, s) for s in seqs.values() for c in SERVICES}

    async def all_dead_lettered() -> bool:
        got = {(d.consumer, d.seq) for d in await bus.dead_letters()}
        return wanted <= got

    try:
        await stack.wait(all_dead_lettered, 20, "every malformed event in the dead-letter stream")
        res.survived = True
    except TimeoutError:
        res.survived = False
    got = {(d.consumer, d.seq) for d in await bus.dead_letters()}
    res.detail = (f"{len(wanted & got)}/{len(wanted)} dead letters "
                  f"({len(bad)} messages x {len(SERVICES)} consumers); decisions went on")


def scenarios() -> list[Scenario]:
    out = [Scenario(f"kill-{k}", f"SIGKILL the {k}, restart it", kill_service(k), quick=k in ("router", "planner"))
           for k in SERVICES]
    out.append(Scenario("kill-nats-leader", "SIGKILL the stream's leader server (1 of 3)", kill_nats_leader, True))
    out += [Scenario(f"corrupt-{k}-snapshot", f"flip a bit of the {k} snapshot, restart it", corrupt_snapshot(k),
                     quick=k == "planner") for k in SNAPSHOT_KINDS]
    out += [
        Scenario("partition-engine", f"{PARTITIONED} stops heartbeating", partition_engine, True),
        Scenario("duplicate-publish", "republish the last 50 events with their ids", duplicate_publish, True),
        Scenario("rewind-consumer", "re-create the router's durable 100 behind its ack floor", rewind_consumer),
        Scenario("malformed-events", "garbage, newer major schema, negative block hash", malformed_events, True),
    ]
    return out


# ============================================================================ accounting
def account(results: list[ScenarioResult], load: Load, stream: list[Delivery], recorded_seqs: set[int] | None,
            divergence_seqs: list[int]) -> None:
    """Fill lost / duplicated / diverged of every result from the final stream."""
    ids = Counter(d.headers.get(MSG_ID) for d in stream if d.headers and d.headers.get(MSG_ID))
    decisions = acting_route_counts(stream)
    for res in results:
        lo, hi = res.published
        pubs = load.published[lo:hi]
        mids = {p.msg_id for p in pubs}
        requests = [p.event.request for p in pubs if isinstance(p.event, RequestSubmitted)]
        s0, s1 = res.window
        c = {
            "ids_missing": sum(1 for m in mids if ids[m] == 0),
            "requests_undecided": sum(1 for r in requests if decisions[r] == 0),
            "not_recorded": 0 if recorded_seqs is None else sum(
                1 for d in stream if s0 < d.seq <= s1 and d.seq not in recorded_seqs),
            "ids_twice": sum(ids[m] - 1 for m in mids if ids[m] > 1),
            "requests_decided_twice": sum(decisions[r] - 1 for r in requests if decisions[r] > 1),
        }
        res.counts = c
        res.lost = c["ids_missing"] + c["requests_undecided"] + c["not_recorded"]
        res.duplicated = c["ids_twice"] + c["requests_decided_twice"]
        res.diverged = sum(1 for s in divergence_seqs if s0 < s <= s1)


# ============================================================================ the run
@dataclass
class ChaosReport:
    results: list[ScenarioResult]
    events: int = 0
    requests: int = 0
    verify: dict[str, Any] = field(default_factory=dict)
    publish_retries: int = 0
    unplanned_exits: list[str] = field(default_factory=list)
    rejoins: list[str] = field(default_factory=list)  # nodes removed for silence, registered again
    elapsed_s: float = 0.0
    quick: bool = False

    @property
    def ok(self) -> bool:
        return all(r.all_zero for r in self.results) and bool(self.verify.get("ok"))

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "quick": self.quick, "elapsed_s": round(self.elapsed_s, 1), "events": self.events,
                "requests": self.requests, "publish_retries": self.publish_retries,
                "unplanned_exits": self.unplanned_exits, "rejoins": self.rejoins, "verify": self.verify,
                "scenarios": [r.to_dict() for r in self.results]}


async def run_chaos(*, quick: bool = False, only: list[str] | None = None, workdir: Path | None = None,
                    rate: float = 20.0, dwell_s: float | None = None, engines: bool = False,
                    on_progress: Callable[[str], None] | None = None) -> ChaosReport:
    """Start the stack, run the scenarios one after the other under load, stop everything, and
    account for every event. ``on_progress(name)`` is called as each scenario starts."""
    from services.adapters.eventlog.duckdb_log import DuckDbEventLog
    from services.drivers.recorder.verify import verify_log

    chosen = [s for s in scenarios() if (s.name in only if only else (s.quick or not quick))]
    if only:
        unknown = set(only) - {s.name for s in scenarios()}
        if unknown:
            raise ValueError(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(s.name for s in scenarios())}")
    dwell_s = (0.5 if quick else 3.0) if dwell_s is None else dwell_s
    t_start = time.monotonic()
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ei-chaos-")
        workdir = Path(tmp.name)
    # real workers on a loaded 2-core machine miss a 2 s heartbeat deadline (all four were removed
    # within 20 s in a trial run): give them 6 s
    stack = Stack(Path(workdir), rate=rate, engines=engines, heartbeat_timeout_s=6.0 if engines else 2.0)
    results: list[ScenarioResult] = []
    try:
        if on_progress:
            on_progress("starting the stack")
        await stack.start()
        baseline = ScenarioResult("steady-load", "no fault (control)")
        plan: list[tuple[ScenarioResult, Scenario | None]] = [(baseline, None)]
        plan += [(ScenarioResult(s.name, s.fault), s) for s in chosen]
        for res, sc in plan:
            if on_progress:
                on_progress(res.name)
            s0 = await stack.bus.last_seq()
            p0 = len(stack.load.published)
            n_unplanned = len(stack.unplanned)
            n_rejoins = len(stack.load.rejoins)
            try:
                if sc is None:
                    await asyncio.sleep(dwell_s)
                    t = time.monotonic()
                    res.recover_s = await _recover(stack, t, await stack.bus.last_seq())
                    res.survived = True
                else:
                    await sc.run(stack, res)
                    await asyncio.sleep(dwell_s)  # keep the load on the recovered stack a while
            except Exception as exc:  # noqa: BLE001 - a scenario that fails is a row, not a crash
                res.survived = False
                res.detail = f"{type(exc).__name__}: {exc}"
                log.error("scenario_failed", scenario=res.name, error=res.detail)
            rejoined = stack.load.rejoins[n_rejoins:]
            if rejoined:
                again = "removed for silence and registered again: " + ", ".join(rejoined)
                res.detail = "; ".join(filter(None, [res.detail, again]))
            exits = stack.unplanned[n_unplanned:]
            if exits:
                res.survived = False
                res.detail = "; ".join(filter(None, [res.detail, "unplanned: " + ", ".join(exits)]))
            res.window = (s0, await stack.bus.last_seq())
            res.published = (p0, len(stack.load.published))
            results.append(res)
        if on_progress:
            on_progress("draining and verifying")
        await stack.stop_load()
        head = await stack.bus.last_seq()
        wanted = set(stack.load.requests())

        async def settled() -> bool:
            if stack.tail.cursor < head:
                return False  # the harness's copy of the stream is not complete yet
            decided = acting_route_counts(stack.tail.deliveries)
            return await stack.caught_up(head) and all(decided[r] for r in wanted)

        with contextlib.suppress(TimeoutError):
            await stack.wait(settled, 30, "every request decided")
        # the last decisions land after the load's last event: the last window ends where the
        # harness's copy of the stream ends once everything is decided
        results[-1].window = (results[-1].window[0], max(head, stack.tail.cursor))
        rcs = await stack.stop_services()
        stack.procs.clear()
        stream = list(stack.tail.deliveries)
        verify: dict[str, Any] = {"ok": False}
        recorded: set[int] | None = None
        div_seqs: list[int] = []
        try:
            with DuckDbEventLog(stack.db, read_only=True) as elog:
                recorded = {row[0] for row in elog.read(1)}
                report = verify_log(elog, keep_going=True)
            verify = report.to_dict()
            div_seqs = [d.seq for d in report.divergences]
        except Exception as exc:  # noqa: BLE001 - an unreadable log is a failed verify, reported
            verify = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        verify["stop_exit_codes"] = rcs
        account(results, stack.load, stream, recorded, div_seqs)
        return ChaosReport(results, events=len(stream), requests=len(wanted), verify=verify,
                           publish_retries=stack.load.retries, unplanned_exits=list(stack.unplanned),
                           rejoins=list(stack.load.rejoins),
                           elapsed_s=time.monotonic() - t_start, quick=quick)
    finally:
        await stack.close()
        if tmp is not None:
            tmp.cleanup()


# ============================================================================ the command
def render(report: ChaosReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 110)  # a log file: no squeezed columns
    table = Table(title=f"evolving chaos{' --quick' if report.quick else ''}: {report.events} events, "
                        f"{report.requests} requests, {report.elapsed_s:.0f} s")
    for col in ("scenario", "survived", "lost", "duplicated", "diverged", "recover s"):
        table.add_column(col, justify="left" if col == "scenario" else "right", no_wrap=True)
    for r in report.results:
        table.add_row(r.name, "[green]yes[/]" if r.survived else "[red]no[/]",
                      _num(r.lost), _num(r.duplicated), _num(r.diverged),
                      "-" if r.recover_s is None else f"{r.recover_s:.2f}")
    console.print(table)
    v = report.verify
    console.print(f"verify (recorder's DuckDB log): {'ok' if v.get('ok') else 'FAILED'}, "
                  f"{v.get('events', 0)} events, reproduced {v.get('reproduced', {})}, "
                  f"divergences {v.get('divergences', v.get('error', '?'))}")
    console.print(f"publish retries: {report.publish_retries}; unplanned exits: "
                  f"{', '.join(report.unplanned_exits) or 'none'}; nodes removed for silence and registered "
                  f"again: {', '.join(report.rejoins) or 'none'}")
    for r in report.results:
        nonzero = ", ".join(f"{k}={v}" for k, v in r.counts.items() if v)
        console.print(f"  {r.name}: {r.fault}" + (f" - {r.detail}" if r.detail else "")
                      + (f" [red]({nonzero})[/]" if nonzero else ""))
    console.print("[green]all zero[/]" if report.ok else "[red]NOT all zero[/]")


def _num(n: int) -> str:
    return "0" if n == 0 else f"[red]{n}[/]"


def _cmd(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    # SIGTERM stops the run like Ctrl-C: the finally blocks stop every child (nothing left behind)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # nats-py logs every refused reconnect with a traceback: expected while a server is down
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    n = len([s for s in scenarios() if (s.name in only if only else (s.quick or not args.quick))]) + 3
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("chaos", total=n)

            def step(name: str) -> None:
                progress.update(task, description=f"chaos: {name}", advance=0 if name == "starting the stack" else 1)

            report = asyncio.run(run_chaos(quick=args.quick, only=only, rate=args.rate, engines=args.engines,
                                           workdir=Path(args.workdir) if args.workdir else None, on_progress=step))
    except ValueError as exc:
        err.print(f"evolving chaos: {exc}")
        return 2
    except KeyboardInterrupt:  # the stack was stopped by run_chaos's finally
        err.print("evolving chaos: interrupted; the stack is stopped")
        return 130
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report)
    return 0 if report.ok else 1


def register(sub, bench) -> None:
    p = sub.add_parser("chaos", help="fault suite over a live stack under load: loss/duplicate/divergence table")
    p.add_argument("--quick", action="store_true", help="the short suite CI runs (about a minute)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]", help="run only these scenarios")
    p.add_argument("--rate", type=float, default=20.0, help="harness requests/s during the run")
    p.add_argument("--engines", action="store_true",
                   help="run a sim engine worker per node (engine.worker) instead of the load generator's nodes; "
                        "partition-engine then SIGSTOPs the worker")
    p.add_argument("--workdir", default=None, help="keep the services' logs and the DuckDB log here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd)


if __name__ == "__main__":  # pragma: no cover
    from services.drivers.cli import main

    sys.exit(main(["chaos", *sys.argv[1:]]))
