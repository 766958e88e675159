"""``python -m services.drivers.serve <name>`` and ``evolving serve <name>``: one live service per process.

Which cores each service folds, what it publishes and which options it takes is the table of
services/drivers/services.py (:data:`~services.drivers.services.SERVICES`); this module builds
a service's runner from its row and runs it.

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
import contextlib
import gc
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import APIError, ServiceUnavailableError

from events.catalog import Tick
from services.adapters.aio import wait_for
from services.adapters.bus import NatsBus, StreamSettings
from services.adapters.bus.options import BusSpec
from services.adapters.bus.security import CredentialsError
from services.adapters.eventlog import DuckDbEventLog
from services.adapters.logging import configure_logging, get_logger
from services.adapters.metrics import MetricsServer, ServiceMetrics
from services.adapters.runner import RunnerConfig, ServiceRunner, cancel_all
from services.cores.corestack import CoreStack
from services.drivers.options import START_RETRY_S, ServiceOptions, add_service_args, service_options
from services.drivers.recorder.service import run_recorder
from services.drivers.services import CONFIG_KEYS, SERVICES, ServiceConfig, ServiceKind

log = get_logger("serve")

#: Exit status of a service that cannot load or build its plug-in: restarting cannot fix it,
#: so ``evolving up`` stops everything and says why (services/drivers/up/launch.py).
EXIT_PLUGIN = 3


class PluginLoadError(RuntimeError):
    """A service could not import or construct its plug-in; ``str()`` is the one-line reason."""


# ---------------------------------------------------------------------------- arguments
def build_parser(kind: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m services.drivers.serve {kind}", description=f"the live {kind} service")
    add_service_args(p, kind)
    p.add_argument("--start-timeout-s", type=float, default=START_RETRY_S,
                   help=f"give up starting (no bus at the URL, or one that keeps failing) after this long, "
                        f"with one line and status 2 (default {START_RETRY_S:.0f}); SIGTERM or SIGINT stops it "
                        "at any time")
    return p


async def connect_bus(bus: BusSpec, name: str) -> NatsBus:
    """The process's :class:`NatsBus`: ``--nats-url`` (one server or a list), its credentials
    (flags, then ``--nats-credentials`` file, then ``EI_NATS_*``), ``--stream-replicas``."""
    creds = bus.auth.credentials()
    return await NatsBus.connect(bus.nats_url, bus.partition, name=name,
                                 settings=StreamSettings(replicas=bus.stream_replicas),
                                 credentials=None if creds.empty else creds)


# ---------------------------------------------------------------------------- core specs
def core_spec(kind: str, opts: ServiceOptions) -> tuple[str, dict[str, Any], str]:
    """``(service name, run_config entry, config key)`` of a directory/planner/router service."""
    conf = _folding(kind).configure(opts.row)
    return conf.name, conf.entry, conf.key


def _folding(kind: str) -> ServiceKind:
    svc = SERVICES.get(kind)
    if svc is None or svc.records:
        raise ValueError(f"no core service named {kind!r}")
    return svc


def build_runner(kind: str, opts: ServiceOptions, bus, metrics: ServiceMetrics | None = None) -> ServiceRunner:
    """The runner of a directory, planner or router service on ``bus``, from its row of the table."""
    svc = _folding(kind)
    conf = svc.configure(opts.row)
    classes = [_load_core(svc, conf, i) for i in range(len(svc.folds))]  # fail fast, before the stream
    cfg = RunnerConfig(name=conf.name, config=conf.runner_config, shadow=conf.shadow,
                       snapshot_every=opts.snapshot_every, snapshot_interval_s=opts.snapshot_interval_s)
    if len(classes) == 1:
        cls, kwargs = classes[0], conf.core_kwargs[0]
        return ServiceRunner(bus, cfg, lambda: cls(**kwargs), cls.from_snapshot, metrics)
    pairs = list(zip(classes, conf.core_kwargs, strict=True))
    return ServiceRunner(
        bus, cfg, lambda: CoreStack([cls(**kw) for cls, kw in pairs]),
        lambda data: CoreStack.restore(data, [cls.from_snapshot for cls in classes]), metrics)


def _load_core(svc: ServiceKind, conf: ServiceConfig, i: int):
    """The class of the service's ``i``-th core. Its own plug-in is built once with its kwargs
    to check them; any failure (not installed, an import error inside the plug-in, bad
    arguments) is a :class:`PluginLoadError`."""
    recipe = svc.recipes[i]
    if i > 0:
        return recipe.load({})
    if recipe.group is None or "plugin" not in conf.entry:
        return recipe.load(conf.entry)
    name = conf.entry["plugin"]
    try:
        cls = recipe.load(conf.entry)
        cls(**conf.core_kwargs[0])
    except Exception as exc:  # whatever the plug-in's import or constructor raises (re-raised, named)
        raise PluginLoadError(f"cannot load {svc.name} plug-in {name!r}: {type(exc).__name__}: {exc}") from exc
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
            await wait_for(stop.wait(), timeout=max(0.0, next_at - loop.time()))
        except TimeoutError:
            pass


async def run_core_service(kind: str, opts: ServiceOptions, bus, stop: asyncio.Event,
                           started: asyncio.Event | None = None, runners: list | None = None) -> ServiceRunner:
    """Run one directory/planner/router service on ``bus`` until ``stop`` (``runners``, when
    given, receives the runner as soon as it is built)."""
    runner = build_runner(kind, opts, bus)
    if runners is not None:
        runners.append(runner)
    svc, row = SERVICES[kind], opts.row
    conf = svc.configure(row)
    await bus.put_snapshot(f"config.{conf.key}", json.dumps(conf.entry, sort_keys=True).encode())
    server = None
    if opts.metrics_port is not None:
        server = await MetricsServer(runner.metrics, runner.health, opts.metrics_host, opts.metrics_port).start()
    tasks = [asyncio.create_task(runner.run(stop), name=f"{kind}-runner")]
    if svc.ticks and row["tick_s"] > 0:
        tasks.append(asyncio.create_task(ticker(bus, row["tick_s"], stop, time_scale=row["time_scale"],
                                                epoch=row["clock_epoch"]), name="planner-ticker"))
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


async def run_recorder_service(opts: ServiceOptions, bus, stop: asyncio.Event, started: asyncio.Event | None = None):
    """Record the stream into ``--db`` until ``stop``; run_config merged at start and stop."""
    row = opts.row
    explicit = _load_run_config(row.get("run_config"))
    event_log = DuckDbEventLog(row["db"], memory_limit=row.get("memory_limit") or None)
    metrics = ServiceMetrics("recorder")
    recorded = metrics.applied.labels("recorder")
    lag = metrics.lag.labels("recorder")

    async def merge_config() -> None:
        cfg = await collect_run_config(bus, explicit)
        if cfg == {"cores": []}:
            return
        # a union with what the log holds: an entry missed by one read (a snapshot store that
        # answered "not found" while a cluster elected its leaders) never drops a core's config
        have = event_log.run_config()
        merged = {**have, **cfg}
        if "cores" not in (explicit or {}):
            merged["cores"] = [k for k in CONFIG_KEYS if k in merged]
        if merged != have:
            await asyncio.to_thread(event_log.set_run_config, merged)

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
    if opts.metrics_port is not None:
        server = await MetricsServer(metrics, health, opts.metrics_host, opts.metrics_port).start()
    inner_stop = asyncio.Event()

    async def drain_then_stop() -> None:
        """On stop, record up to the head seen then (bounded wait), so a clean shutdown of the
        whole system leaves every event in the log."""
        await stop.wait()
        head = await bus.last_seq()
        deadline = asyncio.get_running_loop().time() + row["drain_timeout_s"]
        while event_log.last_seq() < head and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        inner_stop.set()

    watcher = asyncio.create_task(watch())
    drainer = asyncio.create_task(drain_then_stop())
    if started is not None:
        started.set()
    try:
        stats = await run_recorder(bus, event_log, "recorder", flush_interval_s=row["flush_interval_s"],
                                   stop=inner_stop)
        await merge_config()
    finally:
        await cancel_all((watcher, drainer))
        if server is not None:
            await server.stop()
        event_log.close()
    return stats


def transient_bus_error(exc: BaseException) -> bool:
    """An error a later try may not meet: the bus unreachable, a request that timed out, no
    JetStream responder (a cluster electing a leader, a server busy). Not a refused request
    (a bad configuration, a missing permission: JetStream API errors other than 503)."""
    if isinstance(exc, ServiceUnavailableError):
        return True
    if isinstance(exc, APIError):
        return False
    return isinstance(exc, NatsError | TimeoutError | OSError | ConnectionError)


#: how many times a stopped start cancels its pending connect (0.2 s apart) before it leaves it
CANCEL_TRIES = 50


class BusUnreachable(Exception):
    """No bus answered at the URL within the start bound."""


async def _connect_until_stopped(opts: ServiceOptions, stop: asyncio.Event, deadline: float) -> NatsBus | None:
    """:func:`connect_bus`, given up when ``stop`` is set (None: the process was asked to stop;
    nats-py's connect to a URL where nothing listens retries for ever, and a signal handler that
    only sets ``stop`` never ended it: SIGTERM was ignored) or at ``deadline``
    (:class:`BusUnreachable`, one line naming the URL)."""
    loop = asyncio.get_running_loop()
    log.info("bus_connecting", service=opts.kind, url=opts.bus.nats_url)  # SIGTERM / SIGINT stop it from here on
    connect = asyncio.ensure_future(connect_bus(opts.bus, f"evolving-{opts.kind}"))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({connect, stopped}, timeout=max(0.0, deadline - loop.time()),
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if connect in done:
        return connect.result()
    # nats-py's connect loop swallows a cancellation that lands in its own close's wait
    # (nats/aio/client.py ``_close``: ``except (CancelledError, TimeoutError): pass``) and goes on
    # retrying, so one cancel and an unbounded await hung the process now and then under load
    # (SIGINT ignored); ask again until the task ends
    for _ in range(CANCEL_TRIES):
        connect.cancel()
        done, _ = await asyncio.wait({connect}, timeout=0.2)
        if done:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # cancelled mid-connect: nothing to close
                connect.result()
            break
    if stop.is_set():
        return None
    raise BusUnreachable(f"cannot reach the bus at {opts.bus.nats_url} within {opts.start_timeout_s:.0f} s "
                         "(is nats-server running there? `evolving nats` starts one and prints its URL; "
                         "pass it with --nats-url or EI_NATS_URL)")


async def freeze_gc_when_ready(runners: list[ServiceRunner]) -> None:
    """Once the service's runner has folded the backlog it found at start, move every object
    alive then (modules, the restored core) out of the cyclic GC's reach (``gc.freeze()``), as
    vLLM does after its start-up and SGLang's ``freeze_gc`` after warm-up: the later
    collections scan only what the fold allocates since, not the whole process. Without it the
    router's generation-1 collections took 1.5-2 ms of CPU each (16 in 10 s at 100 req/s),
    each one on a route decision's path. Only the service process does this (``evolving
    serve``), never a process that hosts services beside other work (the tests)."""
    while not runners:
        await asyncio.sleep(0.05)
    await runners[0].ready.wait()
    gc.collect()
    gc.freeze()
    log.info("gc_frozen", service=runners[0].cfg.name, objects=gc.get_freeze_count())


async def serve_async(opts: ServiceOptions) -> int:
    """Run the service until SIGTERM/SIGINT. Its start (connect, stream setup, snapshot read,
    consumer creation, the replay up to ready) is tried again, on a fresh connection, while it
    fails on a transient bus error (:func:`transient_bus_error`), for up to
    :data:`START_RETRY_S`: under heavy load or during an election a JetStream request can time
    out, and one such timeout used to exit the service with status 1 (a restarted planner in
    `evolving chaos`). Once the service is ready, an error ends it as before."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    kind = opts.kind
    deadline = loop.time() + opts.start_timeout_s
    attempt = 0
    while True:
        attempt += 1
        runners: list[ServiceRunner] = []
        bus = None
        try:
            bus = await _connect_until_stopped(opts, stop, deadline)
            if bus is None:  # stopped (SIGTERM / SIGINT) while it waited for the bus
                return 0
            if SERVICES[kind].records:
                await run_recorder_service(opts, bus, stop)
            else:
                freezer = asyncio.create_task(freeze_gc_when_ready(runners), name=f"{kind}-gc-freeze")
                try:
                    await run_core_service(kind, opts, bus, stop, runners=runners)
                finally:
                    freezer.cancel()
            return 0
        except (CredentialsError, BusUnreachable) as exc:
            print(f"evolving serve {kind}: {exc}", file=sys.stderr)
            return 2
        except PluginLoadError as exc:
            log.error("plugin_load_failed", service=kind, error=str(exc))
            print(f"evolving serve {kind}: {exc}", file=sys.stderr)
            return EXIT_PLUGIN
        except Exception as exc:
            started = bool(runners) and runners[0].ready.is_set()
            if started or stop.is_set() or not transient_bus_error(exc) or loop.time() > deadline:
                raise
            log.warning("service_start_retry", service=kind, attempt=attempt,
                        error=f"{type(exc).__name__}: {exc}", action="connecting again")
        finally:
            if bus is not None:
                try:
                    await bus.close()
                except Exception as exc:  # noqa: BLE001 - NATS already gone: nothing left to flush
                    log.warning("bus_close_failed", service=kind, error=f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(min(2.0, 0.25 * attempt))


def main(kind: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m services.drivers.serve <kind>``."""
    opts = service_options(kind, build_parser(kind).parse_args(argv))
    configure_logging()
    try:
        return asyncio.run(serve_async(opts))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1], sys.argv[2:]))
