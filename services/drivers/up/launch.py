"""``evolving up``: the whole live system from one command.

Processes (each a child process, as in production; logs in ``--log-dir``, one JSON-lines file
per child):

1. ``nats-server -js`` (embedded, unless ``--nats-url``); stopped last. It runs secured:
   ``up`` generates throwaway accounts (services.adapters.bus.security: one per child, with the subject
   permissions of its role, an ``operator`` account for ``evolving sql --live`` and ``admin``
   for ``up`` itself), writes them to ``RUN_DIR/credentials/<account>.json`` (mode 0600) and
   passes each child only its own file (``--nats-credentials``). ``--insecure`` keeps an open
   server. ``up`` supervises it: if it dies, it is restarted on the same port, store and
   accounts (the children reconnect); if it cannot be, everything stops with one line.
2. The recorder (``python -m services.drivers.serve recorder --db DB``), then the directory, the planner,
   the router and any ``--shadow`` routers (``python -m services.<name>``). ``up`` writes the
   run configuration (plug-in names and arguments) into the DuckDB file before the recorder
   starts, so ``evolving verify DB`` rebuilds the same cores.
3. ``--engines N`` sim engines (``python -m engine.worker --node nI --role R --time-scale S``);
   ``--engines vllm[:N]``: first N vLLM servers (``vllm-nI``, services/drivers/up/vllm.py; not on
   the bus, stopped after their workers), then a worker attached to each (``--attach``: to
   servers someone else started).
4. The gateway (``python -m services.drivers.gateway --port P``).

A child that exits while ``up`` runs is restarted (backoff 1 s doubling to 10 s); the
services rebuild from their snapshots (docs/live.md). The status line (rich) shows the nodes
and their roles, the requests in flight, the last routing and planning decisions and the
children. Ctrl-C (SIGINT) or SIGTERM stops everything in order: gateway, engines, decision
services, recorder (SIGTERM, then SIGKILL after ``--stop-timeout-s``), NATS last.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from rich.live import Live
from rich.table import Table

from events.catalog import (
    NodeRegistered,
    NodeRemoved,
    PlanEvaluated,
    RequestFinished,
    RequestSubmitted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
)
from services.adapters.aio import wait_for
from services.adapters.bus import NatsBus
from services.adapters.bus.natsserver import EmbeddedNats, NatsServerError, free_port
from services.adapters.bus.security import ServiceSpec, generate_accounts, write_credentials
from services.adapters.eventlog import DuckDbEventLog
from services.adapters.logging import get_logger
from services.adapters.plugins import PluginNotFound
from services.adapters.recipes import CORES
from services.drivers.serve import EXIT_PLUGIN
from services.drivers.services import SERVICES
from services.drivers.up import models
from services.drivers.up import vllm as vllm_up
from services.drivers.up.children import (
    G_ENGINE,
    G_GATEWAY,
    G_RECORDER,
    G_SERVER,
    G_SERVICE,
    REPO,
    Child,
    child_env,
    run_config,
)
from services.drivers.up.options import (
    UpSpec,
    engine_kind,
    gateway_options,
    plugin_options,
    ready_timeout_s,
    router_args,
)
from services.drivers.up.partitions import check_partitions, plan_partitioned, wait_partitions

log = get_logger("up")


def plugin_failure(log_path: Path) -> str:
    """The one-line reason a child gave for not loading its plug-in (its ``plugin_load_failed``
    log line), or its log's last line."""
    last = ""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(lines[-200:]):
        line = line.strip()
        if not line:
            continue
        last = last or line
        if '"plugin_load_failed"' in line:
            try:
                return str(json.loads(line).get("error") or line)
            except json.JSONDecodeError:
                return line
    return last or "no log"


@dataclass
class Status:
    """What the status line shows, folded from the stream (from the head at start)."""

    nodes: dict[str, str] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)
    submitted: int = 0
    finished: int = 0
    counts: Counter = field(default_factory=Counter)
    last_route: str = "-"
    last_plan: str = "-"
    last_seq: int = 0

    def fold(self, seq: int, ev) -> None:
        self.last_seq = seq
        self.counts[type(ev).__name__] += 1
        if isinstance(ev, NodeRegistered):
            self.nodes[ev.node] = ev.role
        elif isinstance(ev, RoleSwitchOrdered):
            self.nodes[ev.node] = f"{ev.from_role}->{ev.to_role}"
        elif isinstance(ev, RoleSwitched):
            self.nodes[ev.node] = ev.role
        elif isinstance(ev, NodeRemoved):
            self.nodes.pop(ev.node, None)
        elif isinstance(ev, RequestSubmitted):
            self.submitted += 1
            self.in_flight.add(ev.request)
        elif isinstance(ev, RequestFinished):
            self.finished += 1
            self.in_flight.discard(ev.request)
        elif isinstance(ev, RouteDecided) and not ev.shadow:
            self.last_route = (f"{ev.request} -> P {ev.prefill_node} / D {ev.decode_node} "
                               f"(t_c {ev.t_c}, ttft~{ev.predicted_ttft_s * 1e3:.0f} ms, {ev.policy})")
        elif isinstance(ev, PlanEvaluated):
            chosen = f"{ev.chosen.prefill}P/{ev.chosen.decode}D" if ev.chosen else "keep"
            self.last_plan = f"{chosen}: {ev.reason}"


def _sglang_fake_args(i: int, role: str, ports: list[tuple[int, int]]) -> list[str]:
    """Worker options for engine ``i`` on a fake SGLang server it launches (ports: (http, zmq) per node)."""
    http, kv = ports[i]
    mode = "null" if role == "collocated" else role
    launch = (f"{sys.executable} -m engine.backends.sglang.fake --port {http} --kv-events-port {kv} "
              f"--disaggregation-mode {mode}")
    peers = [f"--peer-url=n{j}=http://127.0.0.1:{p}" for j, (p, _) in enumerate(ports) if j != i]
    return ["--backend", "sglang", "--sglang-launch", launch, "--sglang-url", f"http://127.0.0.1:{http}",
            "--sglang-launch-timeout-s", "60", "--kv-events-endpoint", f"tcp://127.0.0.1:{kv}", *peers]


def router_policy_name(spec: UpSpec) -> str:
    """The in-charge router's policy name (its anomalies' component is ``router.<name>``)."""
    entry = SERVICES["router"].entry(plugin_options(spec))
    kwargs = entry["kwargs"]
    try:
        return str(CORES["router"].build(entry).name)
    except Exception:  # noqa: BLE001 - check_args already refused a plug-in that does not load
        return str(kwargs.get("name") or spec.router)


def account_specs(spec: UpSpec) -> list[ServiceSpec]:
    """The accounts of the children ``plan_children`` starts (same names), plus the operator's."""
    specs = [ServiceSpec("recorder", "recorder"), ServiceSpec("directory", "directory"),
             ServiceSpec("planner", "planner"),
             ServiceSpec("router", "router", components=(f"router.{router_policy_name(spec)}",)),
             *[ServiceSpec("router", f"shadow-{name}", shadow=name) for name in spec.shadow],
             *[ServiceSpec("engine", f"engine-n{i}", node=f"n{i}") for i in range(spec.engines)],
             ServiceSpec("operator", "operator")]
    if not spec.no_gateway:
        specs.append(ServiceSpec("gateway", "gateway"))
    return specs


def torch_engine_env(engines: int, cpus: int | None = None) -> dict[str, str] | None:
    """What each of ``engines`` torch engines of one ``up`` gets: ``OMP_NUM_THREADS`` = this
    machine's cores / engines (at least 1), as ``up`` gives its vLLM servers. Torch takes every
    core for each engine otherwise, and engines on one box then slow each other's iterations
    (1.35-1.55x while the other computes: docs/simulator.md section 9). None where the user set
    ``OMP_NUM_THREADS`` (theirs is kept, children inherit it)."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    n = max(1, (cpus if cpus is not None else os.cpu_count() or 1) // max(1, engines))
    return {"OMP_NUM_THREADS": str(n)}


def plan_children(spec: UpSpec, url: str, run_dir: Path, db: Path,
                  credentials: dict[str, Path] | None = None) -> tuple[list[Child], dict]:
    """The children and the URLs to print; ``credentials`` (account -> file): each child gets
    ``--nats-credentials`` of the account named like it, and nothing else."""
    if spec.partitions > 1:  # one set of children per partition (services/drivers/up/partitions.py)
        return plan_partitioned(spec, url, run_dir, db, plan_children)
    py, logs = sys.executable, run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--nats-url", url, "--partition", spec.partition]
    metrics: dict[str, int] = {}
    next_port = spec.metrics_port

    def mport(name: str) -> list[str]:
        nonlocal next_port
        if spec.metrics_port < 0:
            return []
        port = free_port() if spec.metrics_port == 0 else next_port
        next_port += 1
        metrics[name] = port
        return ["--metrics-port", str(port)]

    def svc(name: str, kind: str, group: int, *extra: str) -> Child:
        return Child(name, [py, "-m", "services.drivers.serve", kind, *common, *extra], group, logs / f"{name}.log")

    children = [svc("recorder", "recorder", G_RECORDER, "--db", str(db), *mport("recorder")),
                svc("directory", "directory", G_SERVICE, *mport("directory")),
                svc("planner", "planner", G_SERVICE, "--planner", spec.planner,
                    *[f"--planner-arg={a}" for a in spec.planner_arg], "--tick-s", str(spec.tick_s),
                    # up's timeout is wall-clock seconds; the watcher compares event ts (model time)
                    "--heartbeat-timeout-s", str(spec.heartbeat_timeout_s * spec.time_scale),
                    "--time-scale", str(spec.time_scale),
                    "--clock-epoch", repr(spec.clock_epoch), *mport("planner")),
                svc("router", "router", G_SERVICE, "--router", spec.router,
                    *[f"--router-arg={a}" for a in router_args(spec)], *mport("router"))]
    for name in spec.shadow:
        children.append(svc(f"shadow-{name}", "router", G_SERVICE, "--router", name, "--shadow", name,
                            *[f"--router-arg={a}" for a in router_args(spec, given=())],
                            *mport(f"shadow-{name}")))
    kind = engine_kind(spec)
    fake_ports = [(free_port(), free_port()) for _ in range(spec.engines)] if kind == "sglang-fake" else []
    if kind == "vllm":
        children += vllm_up.server_children(spec, logs)
    engine_env = torch_engine_env(spec.engines) if kind == "torch" else None
    for i in range(spec.engines):
        role = "collocated" if spec.prefill is None else ("prefill" if i < spec.prefill else "decode")
        extra = ["--profile", spec.profile] if spec.profile else []
        if fake_ports:
            extra += _sglang_fake_args(i, role, fake_ports)
        if kind == "torch":
            extra += models.engine_args(spec.model)
        if kind == "vllm":
            extra += vllm_up.engine_args(spec, i)
        if spec.kv_bytes:
            extra += ["--kv-bytes", "--kv-block-bytes", str(spec.kv_block_bytes)]
        children.append(Child(f"engine-n{i}", [py, "-m", "engine.worker", "--node", f"n{i}", "--role", role,
                                               *common, "--time-scale", str(spec.time_scale),
                                               "--clock-epoch", repr(spec.clock_epoch), "--seed", str(i),
                                               *extra, *mport(f"engine-n{i}"), *spec.engine_arg], G_ENGINE,
                              logs / f"engine-n{i}.log", env=engine_env))
    urls: dict = {"nats": url, "db": str(db), "logs": str(logs),
                  "metrics": {k: f"http://127.0.0.1:{v}/metrics" for k, v in metrics.items()}}
    if kind == "vllm":
        urls["vllm"] = {f"n{i}": s.url for i, s in enumerate(spec.vllm.servers)}
    if not spec.no_gateway:
        port = spec.gateway_port or free_port()
        model = (models.gateway_args(spec.model) if kind == "torch" else
                 vllm_up.gateway_args(spec) if kind == "vllm" else [])
        children.append(Child("gateway", [py, "-m", "services.drivers.gateway", "--host", "127.0.0.1", "--port", str(port),
                                          *common, *model, *gateway_options(spec)], G_GATEWAY, logs / "gateway.log"))
        urls["gateway"] = f"http://127.0.0.1:{port}"
    if credentials is not None:
        for c in children:
            if not c.bus:
                continue
            path = credentials.get(c.name)
            if path is None:
                raise ValueError(f"no NATS account for child {c.name}")
            c.cmd += ["--nats-credentials", str(path)]
        urls["credentials"] = str(next(iter(credentials.values())).parent)
    return children, urls


class Up:
    def __init__(self, spec: UpSpec) -> None:
        self.spec = spec
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(spec.run_dir or REPO / "runs" / stamp)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.db = Path(spec.db) if spec.db else self.run_dir / "run.duckdb"
        self.status = Status()
        self.stop = asyncio.Event()
        self.stopping = False
        self.children: list[Child] = []
        self.urls: dict = {}
        self.failure: str | None = None  # a child could not load its plug-in: stop all, exit EXIT_PLUGIN
        self.exit_code = EXIT_PLUGIN  # of a failure (1: the bus could not be kept up)
        self.nats: EmbeddedNats | None = None
        self.nats_deaths: list[float] = []  # monotonic times the embedded server was found dead
        self._console = None
        self.spec = replace(spec, clock_epoch=time.time())  # model time = epoch + (wall - epoch) * time_scale

    def say(self, msg: str, **kw) -> None:
        if self._console is not None:
            self._console.log(msg + ("  " + " ".join(f"{k}={v}" for k, v in kw.items()) if kw else ""))
        else:
            log.info(msg, **kw)

    def env(self) -> dict[str, str]:
        env = child_env()
        if self.nats is not None and self.nats.accounts:
            # each child's account comes from its --nats-credentials file, nothing else: an
            # EI_NATS_* of the user's shell (a token, another user) must not ride along
            env = {k: v for k, v in env.items() if not k.startswith("EI_NATS_")}
        return env

    async def run(self) -> int:
        nats = None
        url = self.spec.nats_url
        creds, files = self._own_credentials(), None
        if url is None:
            accounts = None
            if not self.spec.insecure:
                accounts = generate_accounts(self.spec.partition, account_specs(self.spec))
                files = write_credentials(accounts, self.run_dir / "credentials")
                creds = accounts["admin"].credentials()
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            nats = self.nats = EmbeddedNats(store_dir=self.run_dir / "nats", own_session=True, accounts=accounts,
                                            log_file=self.run_dir / "logs" / "nats.log").start()
            url = nats.url
        bus = None
        try:
            # creates the streams (the admin's right on a secured bus)
            bus = await NatsBus.connect(url, self.spec.partition, name="evolving-up", credentials=creds)
            with DuckDbEventLog(self.db) as event_log:
                event_log.set_run_config(run_config(self.spec))
            self.children, self.urls = plan_children(self.spec, url, self.run_dir, self.db, files)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.stop.set)
            for group in (G_SERVER, G_RECORDER, G_SERVICE, G_ENGINE, G_GATEWAY):
                for c in self.children:
                    if c.group == group:
                        c.start(self.env())
                if group == G_SERVICE:
                    await self._wait_services(bus)
                    if self.failure is not None:
                        break  # a plug-in did not load: start nothing more
                    await self._wait_metrics(engines=False)  # the start line names the ports: they answer
            if self.failure is None:
                await self._wait_metrics()  # the engines' too (their server starts before they register)
                self.say("started", **start_fields(self.urls))
                # the status line's fold reads every event of the partition: only for a status shown
                watch = asyncio.create_task(self._watch_stream(bus) if self._shows_status() else asyncio.sleep(0))
                ready = asyncio.create_task(self._write_ready(bus))
                try:
                    await self._supervise()
                finally:
                    for t in (watch, ready):
                        t.cancel()
                    await asyncio.gather(watch, ready, return_exceptions=True)
        finally:
            await self._stop_children()
            if bus is not None:
                try:
                    await wait_for(bus.close(), 5.0)
                except Exception as exc:  # noqa: BLE001 - NATS may be gone already; stop anyway
                    log.warning("bus_close_failed", error=str(exc) or type(exc).__name__)
            if nats is not None:
                nats.stop()
        self.say("stopped", db=str(self.db))
        if self.failure is not None:
            print(f"evolving up: {self.failure}", file=sys.stderr)
            return self.exit_code
        return 0

    def _own_credentials(self):
        """``up``'s own credentials on a ``--nats-url`` bus (flags, then ``EI_NATS_*``)."""
        creds = self.spec.auth.credentials()
        return None if creds.empty else creds

    async def _check_bus(self) -> None:
        """The embedded nats-server died: reap it, say so in one line, and start it again on the
        same port, store and accounts (the children's clients reconnect by themselves). If it
        will not start, or dies ``--nats-restarts`` times within a minute, stop everything."""
        nats = self.nats
        if nats is None or nats.proc is None or nats.proc.poll() is None:
            return
        rc = nats.proc.returncode  # poll() reaped it: no zombie
        if nats.proc.stderr:
            nats.proc.stderr.close()
        nats.proc = None
        now = time.monotonic()
        self.nats_deaths = [t for t in self.nats_deaths if now - t < 60.0] + [now]
        if len(self.nats_deaths) > self.spec.nats_restarts:
            self._bus_failed(f"the embedded nats-server exited ({rc}), {len(self.nats_deaths)} time(s) within a "
                             f"minute, more than --nats-restarts {self.spec.nats_restarts}: stopping everything "
                             f"(its log: {nats.log_file})")
            return
        self.say("nats_exited", rc=rc, restarting=nats.url, log=str(nats.log_file))
        try:
            await asyncio.to_thread(nats.start)
        except (NatsServerError, OSError) as exc:
            nats.proc = None
            self._bus_failed(f"the embedded nats-server exited ({rc}) and could not be restarted: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            return
        self.say("nats_restarted", url=nats.url, restarts=len(self.nats_deaths))

    def _bus_failed(self, reason: str) -> None:
        log.error("nats_failed", reason=reason)
        if self.failure is None:
            self.failure, self.exit_code = reason, 1
        self.stop.set()

    async def _wait_services(self, bus, timeout_s: float = 60.0) -> None:
        """Wait until each decision service (shadow routers included) wrote its configuration: it
        loaded its plug-in and is consuming. A child that cannot load its plug-in ends the wait."""
        if self.spec.partitions > 1:
            return await wait_partitions(self, bus, timeout_s)
        keys = ["config.directory", "config.planner", "config.router",
                *[f"config.shadow.{name}" for name in self.spec.shadow]]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            self.check_plugins()
            if self.failure is not None:
                return
            if all([await bus.get_snapshot(k) is not None for k in keys]):
                return
            await asyncio.sleep(0.1)

    async def _wait_metrics(self, timeout_s: float = 15.0, engines: bool = True) -> None:
        """Wait until every service's (and engine's) metrics port accepts connections (bounded)."""
        ports = [int(u.rsplit(":", 1)[1].split("/")[0]) for name, u in self.urls.get("metrics", {}).items()
                 if engines or not name.rsplit("/", 1)[-1].startswith("engine-")]
        deadline = time.monotonic() + timeout_s
        while ports and time.monotonic() < deadline and not self.stop.is_set():
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", ports[0])
                writer.close()
                ports.pop(0)
            except OSError:
                self.check_plugins()
                await asyncio.sleep(0.1)

    def check_plugins(self) -> None:
        """A decision service that exited with ``EXIT_PLUGIN`` cannot load its plug-in; restarting
        will not help: note why and stop everything. (Other children's exit codes mean nothing here.)"""
        for c in self.children:
            if (self.failure is None and c.group == G_SERVICE and c.proc is not None
                    and c.proc.poll() == EXIT_PLUGIN):
                self.failure = f"{c.name} stopped: {plugin_failure(c.log_path)} (log: {c.log_path})"
                log.error("child_plugin_failed", child=c.name, log=str(c.log_path))
                self.stop.set()

    async def _wait_engines(self, bus, timeout_s: float) -> bool:
        """Wait until every engine's ``NodeRegistered`` is on its partition's stream (read from
        sequence 1); after ``timeout_s`` (0: no limit) fail naming the engines still missing."""
        want: dict[str, set[str]] = {}
        for c in self.children:
            if c.group == G_ENGINE:
                want.setdefault(c.cmd[c.cmd.index("--partition") + 1], set()).add(c.cmd[c.cmd.index("--node") + 1])
        seen: set[str] = set()

        async def watch(part: str, nodes: set[str]) -> None:
            b = bus.for_partition(part)
            async with b.consumer(None, start_seq=1, subjects=f"ei.{part}.node.>") as c:
                async for d in c:
                    if isinstance(d.event, NodeRegistered) and d.event.node in nodes:
                        seen.add(d.event.node)
                        if nodes <= seen:
                            return

        if not want:
            return True  # no engines (`--engines 0`): nothing to wait for
        # tasks, not wait_for(gather(...)): when `up` stops first (the bus died, Ctrl-C), cancelling
        # a gather leaves its CancelledError unretrieved and asyncio prints it after our last line
        tasks = [asyncio.create_task(watch(p, n), name=f"wait-engines-{p}") for p, n in want.items()]
        try:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s or None)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if not pending:  # every watch ended: all registered, or one failed with the bus (`up` is stopping)
            return all(not t.cancelled() and t.exception() is None for t in tasks)
        missing = sorted(set().union(*want.values()) - seen)
        logs = ", ".join(str(c.log_path) for c in self.children if c.group == G_ENGINE
                         and c.cmd[c.cmd.index("--node") + 1] in missing)
        self.failure = (f"engine(s) {', '.join(missing)} did not register (NodeRegistered) within "
                        f"--ready-timeout-s {timeout_s:g} s: no ready file (logs: {logs})")
        self.exit_code = 1
        log.error("engines_not_registered", missing=missing, timeout_s=timeout_s)
        self.stop.set()
        return False

    async def _write_ready(self, bus) -> None:
        if not await self._wait_engines(bus, ready_timeout_s(self.spec)):
            return
        gw = self.urls.get("gateway")
        if gw:
            async with aiohttp.ClientSession() as http:
                while True:
                    try:
                        async with http.get(f"{gw}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                            if r.status == 200:
                                break
                    except (TimeoutError, aiohttp.ClientError):
                        pass
                    await asyncio.sleep(0.2)
        self.say("ready", gateway=gw or "-")
        if self.spec.ready_file:
            tmp = Path(self.spec.ready_file + ".tmp")
            pids = {c.name: c.proc.pid for c in self.children if c.proc is not None}
            tmp.write_text(json.dumps({**self.urls, "pids": pids}, indent=2))
            tmp.replace(self.spec.ready_file)

    def _shows_status(self) -> bool:
        """Whether ``up`` draws its live status (a terminal, no ``--no-status``). Without it the
        stream is not read: the status fold was a consumer of every event of the partition,
        heartbeats and ticks included, for nothing (``up``'s 3 ms of CPU a second idle and ~4 ms
        per request of the live bench: docs/experiments.md, "Against the real Dynamo")."""
        return not self.spec.no_status and sys.stderr.isatty()

    async def _watch_stream(self, bus) -> None:
        """Fold the stream into the status line; after a bus failure, resume where it stopped."""
        while True:
            try:
                async with bus.consumer(None, start_seq=self.status.last_seq + 1) as c:
                    async for d in c:
                        self.status.fold(d.seq, d.event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the bus went away: wait, then read on
                log.debug("status_watch_interrupted", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)

    async def _supervise(self) -> None:
        deadline = time.monotonic() + self.spec.run_seconds if self.spec.run_seconds > 0 else None
        live = None
        if self._shows_status():
            live = Live(self._render(), refresh_per_second=4, transient=False)
            live.start()
            self._console = live.console
        try:
            while not self.stop.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self.check_plugins()
                await self._check_bus()
                if self.failure is not None:
                    break
                self._restart_dead()
                if live is not None:
                    live.update(self._render())
                try:
                    await wait_for(self.stop.wait(), timeout=0.25)
                except TimeoutError:
                    pass
        finally:
            if live is not None:
                live.update(self._render())
                live.stop()
                self._console = None

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for c in self.children:
            if c.proc is None or c.proc.poll() is None:
                continue
            if c.down_since is None:
                c.down_since = now
                self.say("child_exited", child=c.name, rc=c.proc.returncode, restart_in_s=c.backoff_s,
                         log=str(c.log_path))
            elif now - c.down_since >= c.backoff_s:
                c.start(self.env())
                c.restarts += 1
                c.down_since = None
                c.backoff_s = min(10.0, c.backoff_s * 2)
                self.say("child_restarted", child=c.name, restarts=c.restarts)

    def _render(self):
        st = self.status
        t = Table.grid(padding=(0, 2))
        nodes = " ".join(f"{n}:{r}" for n, r in sorted(st.nodes.items())) or "-"
        t.add_row("nodes", nodes)
        t.add_row("requests", f"in flight {len(st.in_flight)}  submitted {st.submitted}  finished {st.finished}")
        t.add_row("last route", st.last_route)
        t.add_row("last plan", st.last_plan[:160])
        t.add_row("stream", f"seq {st.last_seq}  route {st.counts['RouteDecided']}  "
                            f"anomalies {st.counts['AnomalyReported']}")
        procs = " ".join(f"{c.name}:{'ok' if c.state == 'running' else c.state}"
                         + (f"(r{c.restarts})" if c.restarts else "") for c in self.children)
        t.add_row("children", procs)
        if "gateway" in self.urls:
            t.add_row("gateway", self.urls["gateway"])
        return t

    async def _stop_children(self) -> None:
        self.stopping = True
        for group in (G_GATEWAY, G_ENGINE, G_SERVER, G_SERVICE, G_RECORDER):
            procs = [c for c in self.children if c.group == group and c.proc is not None and c.proc.poll() is None]
            for c in procs:
                c.proc.send_signal(signal.SIGTERM)
            for c in procs:
                try:
                    await wait_for(asyncio.to_thread(c.proc.wait), timeout=self.spec.stop_timeout_s)
                except TimeoutError:
                    self.say("child_killed", child=c.name, reason="did not stop in time")
                    c.proc.kill()
                    await asyncio.to_thread(c.proc.wait)


def start_fields(urls: dict) -> dict[str, str]:
    """The start line's fields: the gateway URL first, then every metrics port, NATS, DB, logs."""
    out = {"gateway": urls.get("gateway", "-")}
    metrics = urls.get("metrics") or {}
    out["metrics"] = ",".join(f"{name}:{url.rsplit(':', 1)[1].split('/')[0]}" for name, url in metrics.items()) or "off"
    out.update({k: str(v) for k, v in urls.items() if k not in ("gateway", "metrics")})
    return out


def prepare_torch(spec: UpSpec) -> tuple[str | None, UpSpec]:
    """``--engines torch``: check it can run, then fix the model path (absolute, or the default)
    and the planner's settings (models.TORCH_PLANNER_DEFAULTS under the user's) in the spec it
    returns, so the children and the recorded run configuration say the same."""
    problem = models.check_torch(spec)
    if problem is not None:
        return problem, spec
    return None, replace(spec, model=models.model_path(spec), planner_arg=tuple(models.planner_args(spec.planner_arg)))


def check_args(spec: UpSpec) -> str | None:
    """A reason to refuse to start, found before anything is started (plug-in names, arguments)."""
    plugins = [("router", "router", SERVICES["router"].entry(plugin_options(spec))),
               ("planner", "planner", SERVICES["planner"].entry(plugin_options(spec))),
               *[("shadow router", "router", {"plugin": name, "kwargs": {"name": name, "shadow": True}})
                 for name in spec.shadow]]
    for what, core, entry in plugins:
        try:
            CORES[core].build(entry)
        except PluginNotFound as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - an import error inside the plug-in, its own validation error
            return f"cannot load {what} plug-in {entry['plugin']!r}: {type(exc).__name__}: {exc}"
    if (problem := check_partitions(spec)) is not None:
        return problem
    if engine_kind(spec) == "sglang-fake" and spec.time_scale != 1.0:
        return "--engines sglang-fake runs in real time: --time-scale must be 1"
    if spec.model is not None and engine_kind(spec) not in ("torch", "vllm"):
        return "--model names the checkpoint of --engines torch[:N] or vllm[:N]"
    if (spec.attach or spec.attach_kv_events) and engine_kind(spec) != "vllm":
        return "--attach serves vLLM servers someone else started: give it with --engines vllm"
    if spec.engines and importlib.util.find_spec("engine.worker") is None:
        return "engine.worker is not installed: use --engines 0"
    if not spec.no_gateway and importlib.util.find_spec("services.drivers.gateway") is None:
        return "services.drivers.gateway is not installed: use --no-gateway"
    return None


def cmd_up(spec: UpSpec) -> int:
    """``evolving up``, its flags parsed once (services/drivers/up/cli.py: :func:`up_spec`)."""
    problem, kind = None, engine_kind(spec)
    if kind == "torch":
        problem, spec = prepare_torch(spec)
    elif kind == "vllm":
        problem, spec = vllm_up.prepare(spec)
    problem = problem or check_args(spec)
    if problem:
        print(f"evolving up: {problem}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(Up(spec).run())
    except KeyboardInterrupt:
        return 130
