"""The stack under test: a 3-server NATS cluster, the four services (and optionally an engine
worker per node, sim, torch or vllm, and with vllm a vLLM server per node) as child processes,
restarted when they exit unasked, the load and the tail."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from events.catalog import NodeRegistered
from services.adapters.aio import wait_for
from services.adapters.bus import NatsBus, StreamSettings
from services.adapters.bus.natsserver import NatsCluster
from services.adapters.logging import get_logger
from services.drivers.chaos.load import NODES, Load
from services.drivers.chaos.tail import Tail
from services.drivers.chaos.torch_model import TORCH_ENV, torch_worker_args, write_tiny_checkpoint
from services.drivers.chaos.vllm_engines import NODES as VLLM_NODES
from services.drivers.chaos.vllm_engines import WORKER_ENV as VLLM_ENV
from services.drivers.chaos.vllm_engines import VllmServers
from services.drivers.up.testing import REPO, spawn_service

log = get_logger("chaos")
#: ``2026-...Z [warning  ] kv_recompute    key=value key='a value'`` (structlog's console lines)
_CONSOLE = re.compile(r"^\S+ \[\s*\w+\s*\] (?P<event>\S+)(?P<rest>.*)$")
_FIELD = re.compile(r"(\w+)=('[^']*'|\"[^\"]*\"|\S+)")

SERVICES = ("directory", "planner", "router", "recorder")
SNAPSHOT_KINDS = ("directory", "planner", "router")
R3 = StreamSettings(replicas=3)
#: the planner's clock shrunk to the suite's length: it refits every second, ends warm-up after
#: 4 s and evaluates a 4 s window from then on, so its decisions (ModelFitted, PlanEvaluated)
#: are on the stream for verify to check, not only the router's
PLANNER_ARGS = ("warmup_s=4", "fit_interval_s=1", "window_s=4", "slices=4", "cooldown_s=4")


async def connect_when_ready(url: str, partition: str, timeout_s: float = 30.0) -> NatsBus:
    """A fresh cluster answers before it has a JetStream leader: retry the stream setup."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await wait_for(NatsBus.connect(url, partition, settings=R3, name="evolving-chaos"), 10)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


class ChaosCluster:
    """The cluster, the four services as child processes, the load and the tail."""

    def __init__(self, workdir: Path, *, partition: str = "chaos", rate: float = 20.0,
                 heartbeat_s: float = 0.5, heartbeat_timeout_s: float = 2.0, tick_s: float = 0.5,
                 engines: bool = False, kv_bytes: bool = False, engine_backend: str = "sim",
                 model: str | None = None, max_in_flight: int | None = None) -> None:
        # ``--workdir`` may name a folder that does not exist yet (it was a traceback at the first log)
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.partition, self.engines = workdir, partition, engines
        #: ``sim``, ``torch`` (``--engines torch``: the reference engine on ``model``, a tiny
        #: random checkpoint :meth:`start` writes when None; services/drivers/chaos/torch_model.py)
        #: or ``vllm`` (a vLLM server per node on ``model``, SmolLM2 when None; vllm_engines.py)
        self.engine_backend, self.model = engine_backend, model
        #: the nodes and their roles: the load generator's four, or vLLM's two (vllm_engines.py)
        self.nodes = VLLM_NODES if engines and engine_backend == "vllm" else NODES
        self.vllm: VllmServers | None = None  # with --engines vllm, from :meth:`start` on
        #: the workers move real KV bytes (sim ``--kv-bytes``, Mooncake over TCP; the torch engine
        #: always does) and arm a cut transfer on SIGUSR1 (services/drivers/chaos/engine_faults.py)
        self.kv_bytes = kv_bytes or (engines and engine_backend == "torch")
        self.engine_procs: dict[str, subprocess.Popen] = {}
        #: processes a scenario starts for itself (the gateway of restart-gateway): not supervised
        self.extra_procs: dict[str, subprocess.Popen] = {}
        self.rate, self.heartbeat_s, self.max_in_flight = rate, heartbeat_s, max_in_flight
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
        module = "services.drivers.chaos.engine_faults" if self.kv_bytes else "engine.worker"
        cmd = [sys.executable, "-m", module, "--node", node, "--role", role, "--nats-url", self.cluster.url,
               "--partition", self.partition, "--stream-replicas", "3", "--heartbeat-s", str(self.heartbeat_s),
               "--seed", str(len(self.engine_procs)), "--log-format", "json"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if self.engine_backend == "torch":
            cmd += torch_worker_args(self.model)
            env.update(TORCH_ENV)
        elif self.engine_backend == "vllm":
            cmd += self.vllm.worker_args(node)
            env.update(VLLM_ENV)
        elif self.kv_bytes:
            cmd += ["--kv-bytes", "--transfer", "mooncake", "--transfer-host", "127.0.0.1"]
        with open(self.workdir / f"engine-{node}.log", "ab") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.engine_procs[node] = proc
        return proc

    def cut_transfer(self, node: str) -> None:
        """Arm a cut on ``node``'s next KV transfer (``kv_bytes`` workers only)."""
        proc = self.engine_procs.get(node)
        if not self.kv_bytes or proc is None or proc.poll() is not None:
            raise RuntimeError(f"no --kv-bytes worker for {node} to cut a transfer of")
        proc.send_signal(signal.SIGUSR1)

    def engine_log(self, node: str, offset: int = 0) -> list[dict]:
        """The JSON log records of ``node``'s worker after byte ``offset`` of its log."""
        path = self.workdir / f"engine-{node}.log"
        out = []
        if not path.exists():
            return out
        with open(path, "rb") as f:
            f.seek(offset)
            for line in f.read().decode(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:  # a console line (a worker before services.adapters.logging made loggers lazy)
                    m = _CONSOLE.match(line)
                    rec = None if m is None else {"event": m["event"], **{
                        k: v.strip("'\"") for k, v in _FIELD.findall(m["rest"])}}
                if isinstance(rec, dict):
                    out.append(rec)
        return out

    def engine_log_size(self, node: str) -> int:
        path = self.workdir / f"engine-{node}.log"
        return path.stat().st_size if path.exists() else 0

    def kill_engine(self, node: str) -> None:
        proc = self.engine_procs.get(node)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a stopped worker dies of SIGKILL all the same; be explicit
            proc.kill()
            proc.wait()

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
                self.spawn_engine(node, dict(self.nodes)[node])
        if self.vllm is not None:
            self.vllm.supervise(self.unplanned)

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
        if self.engines and self.engine_backend == "torch" and self.model is None:
            self.model = str(await asyncio.to_thread(write_tiny_checkpoint, self.workdir / "tiny-llama.gguf"))
        if self.engines and self.engine_backend == "vllm":  # minutes to load: first, beside the rest
            self.vllm = await asyncio.to_thread(VllmServers, self.workdir, self.model, self.nodes)
            self.vllm.start()
        self.cluster = NatsCluster(3, name="chaos")
        await asyncio.to_thread(self.cluster.start)
        self.bus = await connect_when_ready(self.cluster.url, self.partition)
        for kind in SERVICES:
            self.spawn(kind)
        # 120 s: a CI run of 2 Dec 2026 (load ~6) saw `chaos` exit 1 before the router had logged
        # its catch-up; its stderr was not kept (tests/integration/test_chaos.py prints it now), and
        # this 60 s wait was the likeliest start-up step to have ended it
        await self.wait(lambda: self.caught_up(0), 120, "the services to start")
        self.load = Load(self.bus, rate=self.rate, heartbeat_s=self.heartbeat_s, max_in_flight=self.max_in_flight)
        if self.engines:
            self.load.nodes = ()
            if self.vllm is not None:  # a worker waits for its server, but the registration waits below do not
                await self.wait(self.vllm_healthy, 900, "the vLLM servers to load", every_s=1.0)
            for node, role in self.nodes:
                self.spawn_engine(node, role)
        self.tail_bus = await connect_when_ready(self.cluster.url, self.partition)
        self.tail = Tail(self.tail_bus)
        self.load.tail = self.tail
        self._tasks = [asyncio.create_task(self.load.run(self._stop_load), name="chaos-load"),
                       asyncio.create_task(self.tail.run(self._stop_tail), name="chaos-tail")]
        # four workers starting on a busy 2-core machine take a while to register (one run at
        # load average 19 missed a 30 s deadline)
        # (--kv-bytes workers import torch and start Mooncake first: one run at load average 25-34
        # had none registered after 90 s)
        await self.wait(lambda: self.decided_since(0.0), (240 if self.kv_bytes else 90) if self.engines else 30,
                        "a first decision")
        if self.engines:  # every worker is up before the first fault (a torch worker loading its model
            # under load registered 25 s after the first decision, after partition-engine had stopped it)
            await self.wait(self.all_registered, 240 if self.kv_bytes else 90, "every engine worker to register")

    async def all_registered(self) -> bool:
        seen = {d.event.node for d in self.tail.deliveries if type(d.event) is NodeRegistered}
        return all(node in seen for node, _ in self.nodes)

    async def vllm_healthy(self) -> bool:
        return all(await asyncio.gather(*(asyncio.to_thread(self.vllm.healthy, n) for n in self.vllm.nodes)))

    async def decided_since(self, t: float) -> bool:
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
                ok = await wait_for(pred(), 15)
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
            await wait_for(self._tasks[0], 60)

    async def stop_services(self) -> dict[str, int | None]:
        """SIGTERM every service (the recorder drains to the head) and wait."""
        rcs: dict[str, int | None] = {}
        for name, proc in self.extra_procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    rcs[name] = await wait_for(asyncio.to_thread(proc.wait), 30)
                except TimeoutError:
                    proc.kill()
                    rcs[name] = None
        for proc in self.engine_procs.values():  # all at once: each flushes its own queue meanwhile
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for node, proc in self.engine_procs.items():
            try:
                rcs[f"engine-{node}"] = await wait_for(asyncio.to_thread(proc.wait), 30)
            except TimeoutError:
                proc.kill()
                rcs[f"engine-{node}"] = None
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for kind, proc in self.procs.items():
            try:
                rcs[kind] = await wait_for(asyncio.to_thread(proc.wait), 30)
            except TimeoutError:
                proc.kill()
                rcs[kind] = None
        return rcs

    async def close(self) -> None:
        """Stop everything that is still running (idempotent; called from ``finally``).

        The child processes are stopped whatever the awaits before them raise: on SIGTERM this
        runs while ``asyncio.run`` cancels the run's task, so an await here may be cancelled
        (``CancelledError`` is no ``Exception``), and nothing may be left behind then."""
        self._stop_load.set()
        self._stop_tail.set()
        for t in self._tasks:
            t.cancel()
        try:
            for t in self._tasks:
                with contextlib.suppress(BaseException):
                    await wait_for(t, 5)
        finally:
            for kind in list(self.procs):
                self.kill(kind)
            for proc in self.extra_procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for proc in self.engine_procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)  # a stopped worker cannot die of SIGKILL's cleanup
                    proc.kill()
                    proc.wait()
            if self.vllm is not None:
                self.vllm.stop()
            try:
                if self._http is not None:
                    with contextlib.suppress(Exception):
                        await self._http.close()
                for bus in (self.tail_bus, self.bus):
                    if bus is not None:
                        with contextlib.suppress(Exception):
                            await wait_for(bus.close(), 5)
            finally:
                if self.cluster is not None:
                    self.cluster.stop()  # in this thread: a cancelled await must not skip it
