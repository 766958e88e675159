"""``python -m services.<name>`` and ``evolving serve <name>``: one live service per process.

=========  ===================================  ==========================================
service    core(s)                              publishes
=========  ===================================  ==========================================
directory  ``DirectoryCore``                    ``AnomalyReported``
planner    planner plug-in + ``LivenessWatcher`` ``ModelFitted``, ``PlanEvaluated``,
                                                ``RoleSwitchOrdered``, ``SwitchRole``,
                                                ``NodeRemoved``, ``AnomalyReported``; and
                                                ``Tick`` every ``--tick-s`` (adapter clock)
router     router plug-in                       ``RouteDecided``, ``AnomalyReported``
           (``--shadow``: under ``ei.<p>.shadow.<name>.>``)
recorder   ``Recorder`` (services.adapters.eventlog)     nothing: lands the stream in DuckDB
=========  ===================================  ==========================================

Each service writes its core configuration to the bus's snapshot store under
``config.<service>`` (``{"plugin": ..., "kwargs": ...}``, the shape ``evolving verify``
reads); the recorder merges those entries into the log's ``run_config`` when it starts and
when it stops, and ``evolving up`` writes them before the recorder starts.

A service that cannot import or build its plug-in logs ``plugin_load_failed``, prints one line
(``evolving serve router: cannot load router plug-in 'x': ImportError: ...``) and exits with
status 3 (:data:`EXIT_PLUGIN`); ``evolving up`` then stops everything and repeats that line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from events.catalog import Tick
from services.adapters.logging import get_logger
from services.adapters.metrics import MetricsServer, ServiceMetrics
from services.adapters.runner import RunnerConfig, ServiceRunner, cancel_all
from services.cores.corestack import CoreStack
from services.cores.liveness import LivenessWatcher

log = get_logger("serve")

SERVICES = ("directory", "planner", "router", "recorder")
CONFIG_KEYS = ("directory", "planner", "router")
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
#: Exit status of a service that cannot load or build its plug-in: restarting cannot fix it,
#: so ``evolving up`` stops everything and says why (services/drivers/up/launch.py).
EXIT_PLUGIN = 3


class PluginLoadError(RuntimeError):
    """A service could not import or construct its plug-in; ``str()`` is the one-line reason."""


# ---------------------------------------------------------------------------- arguments
def parse_kv(items: Sequence[str] | None) -> dict[str, Any]:
    """``["k=v", ...]`` -> kwargs; a value that parses as JSON is taken as JSON (numbers,
    booleans, lists), else as a string."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def add_bus_args(p: argparse.ArgumentParser) -> None:
    """``--nats-url`` (a comma-separated server list for a cluster), ``--partition``,
    ``--stream-replicas`` and the credentials options (services.adapters.bus.security.add_cli_options)."""
    from services.adapters.bus.security import add_cli_options

    p.add_argument("--nats-url", default=os.environ.get("EI_NATS_URL", DEFAULT_NATS_URL),
                   help="NATS server URL, or a comma-separated list of a cluster's servers (env EI_NATS_URL)")
    p.add_argument("--partition", default=os.environ.get("EI_PARTITION", "default"))
    p.add_argument("--stream-replicas", type=int, default=env_int("EI_STREAM_REPLICAS", 1),
                   help="replicas of the partition's stream and of this service's snapshot bucket "
                        "(3 on a 3-server cluster; env EI_STREAM_REPLICAS; default 1)")
    add_cli_options(p)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from None


async def connect_bus(args, name: str):
    """The service's :class:`NatsBus`: ``args.nats_url`` (one server or a list), its credentials
    (flags, then ``--nats-credentials`` file, then ``EI_NATS_*``), ``--stream-replicas``."""
    from services.adapters.bus.nats_bus import NatsBus, StreamSettings
    from services.adapters.bus.security import credentials_from_args

    creds = credentials_from_args(args)
    settings = StreamSettings(replicas=getattr(args, "stream_replicas", 1) or 1)
    return await NatsBus.connect(args.nats_url, args.partition, name=name, settings=settings,
                                 credentials=None if creds.empty else creds)


def add_common(p: argparse.ArgumentParser) -> None:
    add_bus_args(p)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics and /healthz on this port (0: a free port; default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--snapshot-every", type=int, default=5000, help="events between snapshots")
    p.add_argument("--snapshot-interval-s", type=float, default=5.0, help="seconds between snapshots")


def add_service_args(p: argparse.ArgumentParser, kind: str) -> None:
    add_common(p)
    if kind == "router":
        p.add_argument("--router", default="evolving", help="router plug-in name (evolving.routers)")
        p.add_argument("--router-arg", action="append", default=[], metavar="K=V",
                       help="router constructor keyword (repeatable)")
        p.add_argument("--shadow", default=None, metavar="NAME",
                       help="run in shadow under this name: decisions go to ei.<p>.shadow.NAME.>")
    elif kind == "planner":
        p.add_argument("--planner", default="evolving", help="planner plug-in name (evolving.planners)")
        p.add_argument("--planner-arg", action="append", default=[], metavar="K=V")
        p.add_argument("--tick-s", type=float, default=1.0, help="Tick period, wall clock (0: no ticks)")
        p.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                       help="NodeRemoved after this long without a node event (0: never)")
        p.add_argument("--time-scale", type=float, default=1.0,
                       help="Tick ts = epoch + (wall - epoch) * scale (match the engines' --time-scale)")
        p.add_argument("--clock-epoch", type=float, default=None, help="epoch of the scaled clock (default: now)")
    elif kind == "recorder":
        p.add_argument("--db", required=True, help="DuckDB file of the run")
        p.add_argument("--run-config", default=None, help="JSON file (or inline JSON) merged into run_config")
        p.add_argument("--flush-interval-s", type=float, default=0.2)
        p.add_argument("--drain-timeout-s", type=float, default=5.0,
                       help="on stop, wait this long at most to record up to the stream head")


def build_parser(kind: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m services.drivers.serve {kind}", description=f"the live {kind} service")
    add_service_args(p, kind)
    return p


# ---------------------------------------------------------------------------- core specs
def core_spec(kind: str, args) -> tuple[str, dict[str, Any], str]:
    """``(service name, run_config entry, config key)`` of a directory/planner/router service."""
    if kind == "directory":
        return "directory", {}, "directory"
    if kind == "planner":
        return "planner", {"plugin": args.planner, "kwargs": parse_kv(args.planner_arg)}, "planner"
    if kind == "router":
        kwargs = parse_kv(args.router_arg)
        if args.shadow:
            kwargs.update(name=args.shadow, shadow=True)
            return f"shadow-{args.shadow}", {"plugin": args.router, "kwargs": kwargs}, f"shadow.{args.shadow}"
        return "router", {"plugin": args.router, "kwargs": kwargs}, "router"
    raise ValueError(f"no core service named {kind!r}")


def build_runner(kind: str, args, bus, metrics: ServiceMetrics | None = None) -> ServiceRunner:
    """The runner of a directory, planner or router service on ``bus``."""
    from services.adapters.plugins import load_planner, load_router

    name, entry, _key = core_spec(kind, args)
    common = {"snapshot_every": args.snapshot_every, "snapshot_interval_s": args.snapshot_interval_s}
    if kind == "directory":
        from services.cores.directory.core import DirectoryCore

        cfg = RunnerConfig(name=name, config=entry, **common)
        return ServiceRunner(bus, cfg, DirectoryCore, DirectoryCore.from_snapshot, metrics)
    if kind == "router":
        kwargs = entry["kwargs"]
        cls = _load_plugin("router", load_router, args.router, kwargs)  # fail fast, before the stream
        cfg = RunnerConfig(name=name, config=entry, shadow=args.shadow, **common)
        return ServiceRunner(bus, cfg, lambda: cls(**kwargs), cls.from_snapshot, metrics)
    if kind == "planner":
        kwargs = entry["kwargs"]
        cls = _load_plugin("planner", load_planner, args.planner, kwargs)
        timeout = args.heartbeat_timeout_s
        cfg = RunnerConfig(name=name, config={**entry, "heartbeat_timeout_s": timeout}, **common)
        return ServiceRunner(
            bus, cfg, lambda: CoreStack([cls(**kwargs), LivenessWatcher(timeout)]),
            lambda data: CoreStack.restore(data, [cls.from_snapshot, LivenessWatcher.from_snapshot]), metrics)
    raise ValueError(f"no core service named {kind!r}")


def _load_plugin(kind: str, load, name: str, kwargs: dict[str, Any]):
    """The plug-in class ``name``, built once with ``kwargs`` to check them; any failure (not
    installed, an import error inside the plug-in, bad arguments) is a :class:`PluginLoadError`."""
    try:
        cls = load(name)
        cls(**kwargs)
    except Exception as exc:  # whatever the plug-in's import or constructor raises (re-raised, named)
        raise PluginLoadError(f"cannot load {kind} plug-in {name!r}: {type(exc).__name__}: {exc}") from exc
    return cls


# ---------------------------------------------------------------------------- running
async def ticker(bus, period_s: float, stop: asyncio.Event, src: str = "planner", time_scale: float = 1.0,
                 epoch: float | None = None) -> None:
    """Publish ``Tick`` every ``period_s`` of wall time: the planner core's only clock. Its ``ts``
    is wall-clock seconds, or with ``time_scale != 1`` the model time
    ``epoch + (wall - epoch) * time_scale`` that the sim engines are meant to share."""
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    epoch = time.time() if epoch is None else epoch
    while not stop.is_set():
        try:
            await bus.publish(Tick(ts=epoch + (time.time() - epoch) * time_scale, src=src))
        except Exception as exc:  # noqa: BLE001 - a cluster electing a leader: skip this pulse, not the service
            log.warning("tick_publish_failed", error=f"{type(exc).__name__}: {exc}", action="next period")
        next_at = max(next_at + period_s, loop.time() - period_s)  # after a stall: no burst of ticks
        try:
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, next_at - loop.time()))
        except TimeoutError:
            pass


async def run_core_service(kind: str, args, bus, stop: asyncio.Event,
                           started: asyncio.Event | None = None) -> ServiceRunner:
    """Run one directory/planner/router service on ``bus`` until ``stop``."""
    runner = build_runner(kind, args, bus)
    _name, entry, key = core_spec(kind, args)
    await bus.put_snapshot(f"config.{key}", json.dumps(entry, sort_keys=True).encode())
    server = None
    if args.metrics_port is not None:
        server = await MetricsServer(runner.metrics, runner.health, args.metrics_host, args.metrics_port).start()
    tasks = [asyncio.create_task(runner.run(stop), name=f"{kind}-runner")]
    if kind == "planner" and args.tick_s > 0:
        tasks.append(asyncio.create_task(ticker(bus, args.tick_s, stop, time_scale=args.time_scale,
                                                epoch=args.clock_epoch), name="planner-ticker"))
    if started is not None:
        started.set()
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()
        await asyncio.gather(*tasks)
    finally:
        await cancel_all(tasks)
        if server is not None:
            await server.stop()
    return runner


def _load_run_config(spec: str | None) -> dict[str, Any]:
    if not spec:
        return {}
    if spec.lstrip().startswith("{"):
        return json.loads(spec)
    with open(spec, encoding="utf-8") as fh:
        return json.load(fh)


async def collect_run_config(bus, explicit: dict[str, Any] | None = None) -> dict[str, Any]:
    """Core configurations the services wrote to the bus, plus ``explicit`` (which wins)."""
    out: dict[str, Any] = {}
    for key in CONFIG_KEYS:
        data = await bus.get_snapshot(f"config.{key}")
        if data is not None:
            out[key] = json.loads(data)
    out.update(explicit or {})
    if "cores" not in out:
        out["cores"] = [k for k in CONFIG_KEYS if k in out]
    return out


async def run_recorder_service(args, bus, stop: asyncio.Event, started: asyncio.Event | None = None):
    """Record the stream into ``args.db`` until ``stop``; run_config merged at start and stop."""
    from services.adapters.eventlog.duckdb_log import DuckDbEventLog
    from services.drivers.recorder.service import run_recorder

    explicit = _load_run_config(args.run_config)
    event_log = DuckDbEventLog(args.db)
    metrics = ServiceMetrics("recorder")
    recorded = metrics.applied.labels("recorder")
    lag = metrics.lag.labels("recorder")

    async def merge_config() -> None:
        cfg = await collect_run_config(bus, explicit)
        if cfg != {"cores": []} and cfg != event_log.run_config():
            await asyncio.to_thread(event_log.set_run_config, cfg)

    def health() -> dict[str, Any]:
        return {"service": "recorder", "ready": True, "applied_seq": event_log.last_seq()}

    folded, dead = metrics.folded.labels("recorder"), metrics.dead_letters.labels("recorder")

    async def watch() -> None:
        seen, seen_dl = event_log.last_seq(), 0
        while not inner_stop.is_set():
            head = await bus.last_seq()
            applied = event_log.last_seq()
            recorded.set(applied)
            lag.set(max(0, head - applied))
            folded.inc(max(0, applied - seen))  # sequences committed (dead letters included)
            seen = max(seen, applied)
            bus_dl = getattr(bus, "dead_lettered", 0)
            dead.inc(max(0, bus_dl - seen_dl))
            seen_dl = max(seen_dl, bus_dl)
            await asyncio.sleep(1.0)

    await merge_config()
    server = None
    if args.metrics_port is not None:
        server = await MetricsServer(metrics, health, args.metrics_host, args.metrics_port).start()
    inner_stop = asyncio.Event()

    async def drain_then_stop() -> None:
        """On stop, record up to the head seen then (bounded wait), so a clean shutdown of the
        whole system leaves every event in the log."""
        await stop.wait()
        head = await bus.last_seq()
        deadline = asyncio.get_running_loop().time() + args.drain_timeout_s
        while event_log.last_seq() < head and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        inner_stop.set()

    watcher = asyncio.create_task(watch())
    drainer = asyncio.create_task(drain_then_stop())
    if started is not None:
        started.set()
    try:
        stats = await run_recorder(bus, event_log, "recorder", flush_interval_s=args.flush_interval_s,
                                   stop=inner_stop)
        await merge_config()
    finally:
        await cancel_all((watcher, drainer))
        if server is not None:
            await server.stop()
        event_log.close()
    return stats


async def serve_async(kind: str, args) -> int:
    from services.adapters.bus.security import CredentialsError

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        bus = await connect_bus(args, f"evolving-{kind}")
    except CredentialsError as exc:
        print(f"evolving serve {kind}: {exc}", file=sys.stderr)
        return 2
    try:
        if kind == "recorder":
            await run_recorder_service(args, bus, stop)
        else:
            await run_core_service(kind, args, bus, stop)
    except PluginLoadError as exc:
        log.error("plugin_load_failed", service=kind, error=str(exc))
        print(f"evolving serve {kind}: {exc}", file=sys.stderr)
        return EXIT_PLUGIN
    finally:
        try:
            await bus.close()
        except Exception as exc:  # noqa: BLE001 - NATS already gone: nothing left to flush
            log.warning("bus_close_failed", service=kind, error=f"{type(exc).__name__}: {exc}")
    return 0


def main(kind: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m services.drivers.serve <kind>``."""
    from services.adapters.logging import configure_logging

    args = build_parser(kind).parse_args(argv)
    configure_logging()
    try:
        return asyncio.run(serve_async(kind, args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1], sys.argv[2:]))
