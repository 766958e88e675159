"""The worker process, ``python -m engine.worker``: its command line and ``main``. Parse the
arguments, check them before touching the bus (a bad profile, ``--kv-bytes`` without torch or
Mooncake, a backend's own options: one line, exit 2), build the backend, run one
``EngineWorker`` until SIGTERM/SIGINT, with ``/metrics`` and ``/healthz`` when asked."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable

from engine.backend import BackendUnavailable
from engine.backends.sglang.backend import SglangBackend
from engine.backends.sglang.options import add_arguments, check_args, config_from_args
from engine.backends.torch import options as torch_options
from engine.backends.vllm import options as vllm_options
from engine.backends.vllm.backend import VllmBackend
from engine.profiles import load_profile
from engine.transfer import TransferError
from engine.transfer.exit import exit_process
from engine.worker.loop import BACKENDS, ROLES, EngineWorker
from engine.worker.publish import _retryable
from kernels.layout import KvLayoutError
from services.adapters.bus import NatsBus, StreamSettings
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.options import bus_auth
from services.adapters.bus.security import CredentialsError, add_cli_options
from services.adapters.bus.tokens import NatsTokens
from services.adapters.logging import configure_logging, get_logger
from services.adapters.metrics import MetricsServer
from services.cores.directory.eviction import POLICIES

log = get_logger("worker")


def _env_epoch() -> float | None:
    raw = os.environ.get("EI_CLOCK_EPOCH", "").strip()
    return float(raw) if raw else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.worker",
                                description="one engine node on the bus: the sim node model or one SGLang server "
                                            "(engine/backend.py is the port; docs/engines.md)")
    p.add_argument("--node", required=True, help="node id (unique in the partition)")
    p.add_argument("--role", choices=ROLES, default="collocated", help="initial role (default collocated)")
    p.add_argument("--profile", default="gb300-glm52",
                   help="deploy/profiles/<name>.toml or a path: capacities and block size the node registers "
                        "with (and the sim's ground-truth timings)")
    p.add_argument("--nats-url", default=os.environ.get("EI_NATS_URL") or None,
                   required=not os.environ.get("EI_NATS_URL"),
                   help="NATS server, e.g. nats://127.0.0.1:4222, or a comma-separated list of a cluster's "
                        "servers (default: env EI_NATS_URL)")
    p.add_argument("--stream-replicas", type=int, default=int(os.environ.get("EI_STREAM_REPLICAS") or 1),
                   help="replicas of the stream and of this node's snapshot bucket (env EI_STREAM_REPLICAS)")
    p.add_argument("--partition", default="default", help="bus partition (default: default)")
    p.add_argument("--backend", choices=BACKENDS, default="sim",
                   help="sim: simulated node; sglang: drive one SGLang server; vllm: attach to one running vLLM "
                        "server; torch: the reference engine computing in torch (options below)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="model seconds per wall-clock second (1 = real time, 10 = ten times faster; "
                        "sglang needs 1)")
    p.add_argument("--clock-epoch", type=float, default=_env_epoch(),
                   help="epoch of the scaled clock shared by a run's processes (default: env "
                        "EI_CLOCK_EPOCH, else now)")
    p.add_argument("--seed", type=int, default=0, help="sim: noise seed")
    p.add_argument("--fetch-mode", choices=("async", "at_start", "none"), default="async",
                   help="sim: how peer KV is fetched (docs/simulator.md)")
    p.add_argument("--eviction", choices=sorted(POLICIES), default="count_aware",
                   help="eviction order of the node's KV pool (the directory's policy)")
    p.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="wall-clock seconds between NodeHeartbeat events (heartbeat_s * time_scale model seconds; "
                        "keep it under the planner's --heartbeat-timeout-s / time_scale)")
    p.add_argument("--token-interval-s", type=float, default=0.2,
                   help="seconds between token progress reports to the gateway")
    p.add_argument("--snapshot-every", type=int, default=2000,
                   help="folded events between snapshots of the worker's view (engine-<node>)")
    p.add_argument("--kv-bytes", action="store_true",
                   help="sim: real bytes behind the KV pool, moved between workers with Mooncake over TCP and "
                        "checksum-verified (engine/kvplane.py, docs/kernels.md)")
    p.add_argument("--kv-block-bytes", type=int, default=1024,
                   help="--kv-bytes: bytes per KV block (a multiple of 2 x block_tokens; default 1024)")
    p.add_argument("--transfer", choices=("mooncake",), default="mooncake",
                   help="--kv-bytes: transfer backend between worker processes (loopback is in-process only)")
    p.add_argument("--transfer-host", default="127.0.0.1",
                   help="--kv-bytes: address the transfer engine and the KV control channel listen on")
    p.add_argument("--prompt-store", choices=("auto", "on", "off"), default="auto",
                   help="read each job's token ids from the gateway's prompt bucket EI_PROMPTS_<P> (docs/engines.md, "
                        "Prompts); auto: on for every backend but sim")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="serve /metrics and /healthz on this port (0: a free port; -1, the default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port (default 127.0.0.1)")
    p.add_argument("--log-format", choices=["console", "json"], default=None,
                   help="log lines as console text or JSON (default: the services' setting)")
    p.add_argument("--log-level", default=None, help="debug, info, warning or error (default info)")
    add_arguments(p)
    vllm_options.add_arguments(p)
    torch_options.add_arguments(p)
    add_cli_options(p)
    return p


async def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    backend: str | Callable = "sim"
    attached = {"sglang": (SglangBackend, config_from_args), "vllm": (VllmBackend, vllm_options.config_from_args)}
    if args.backend in attached:  # an SGLang or vLLM server: check it before touching the bus
        cls, config = attached[args.backend]
        cfg = config(args)
        backend = lambda host, w: cls(host, w.src, args.role, profile, cfg)
        try:
            if not cfg.wait_s:  # fail before touching the bus: one line, exit 2
                await cls.preflight(cfg)
        except BackendUnavailable as exc:
            print(f"engine.worker: {exc}", file=sys.stderr)
            return 2
    elif args.backend == "torch":
        backend = torch_options.make_backend(args, profile)
    try:
        creds = bus_auth(args).credentials()
    except CredentialsError as exc:
        print(f"engine.worker: {exc}", file=sys.stderr)
        return 2
    deadline = asyncio.get_running_loop().time() + 60.0
    while True:  # a transient bus error at start (a busy or electing cluster) is tried again
        try:
            bus = await NatsBus.connect(args.nats_url, partition=args.partition, name=f"engine-{args.node}",
                                        credentials=None if creds.empty else creds,
                                        settings=StreamSettings(replicas=args.stream_replicas))
            break
        except Exception as exc:
            if not _retryable(exc) or asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("connect_retry", node=args.node, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.5)
    kv = None
    if args.kv_bytes:
        import torch  # lazy: optional dependency (torch; --kv-bytes only)

        from engine.kvplane import KvBytesConfig  # lazy: optional dependency (torch; --kv-bytes only)

        # small batched ops on a node that shares its cores: intra-op threads only spin (a 2000-block
        # store took 120-480 ms with torch's default threads on a loaded 2-core box, 7-25 ms with one)
        torch.set_num_threads(1)
        kv = KvBytesConfig(block_bytes=args.kv_block_bytes, transfer=args.transfer, host=args.transfer_host)
    try:
        worker = EngineWorker(bus, NatsTokens.from_bus(bus, args.partition), args.node, args.role, profile,
                              seed=args.seed, time_scale=args.time_scale, fetch_mode=args.fetch_mode,
                              eviction=args.eviction, heartbeat_s=args.heartbeat_s,
                              token_interval_s=args.token_interval_s, clock_epoch=args.clock_epoch,
                              backend=backend, snapshot_every=args.snapshot_every, kv_bytes=kv,
                              prompts=_prompt_store(args, bus))
    except (TransferError, KvLayoutError) as exc:
        print(f"engine.worker: --kv-bytes: {exc}", file=sys.stderr)
        await bus.close()
        return 2
    # the heartbeats' own connection, used from their own thread (engine/worker/publish.py)
    worker.heartbeat_bus = lambda: NatsBus.connect(
        args.nats_url, partition=args.partition, name=f"engine-{args.node}-heartbeat",
        credentials=None if creds.empty else creds, settings=StreamSettings(replicas=args.stream_replicas),
        ensure=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = None
    if args.metrics_port >= 0:  # before start: the port answers while the worker catches up
        server = await MetricsServer(worker.metrics, worker.health, args.metrics_host, args.metrics_port).start()
    try:
        await worker.start()
    except BackendUnavailable as exc:
        print(f"engine.worker: {exc}", file=sys.stderr)
        if server is not None:
            await server.stop()
        await bus.close()
        return 2
    await stop.wait()
    await worker.stop("shutdown")
    if server is not None:
        await server.stop()
    await bus.close()
    return 0


def _prompt_store(args: argparse.Namespace, bus) -> NatsPromptStore | None:
    """The prompt store this worker reads job token ids from (``--prompt-store``), or None."""
    if args.prompt_store == "off" or (args.prompt_store == "auto" and args.backend == "sim"):
        return None
    return NatsPromptStore.from_bus(bus, args.partition)


def _kv_bytes_preflight(args: argparse.Namespace) -> str:
    """Why ``--kv-bytes`` cannot run here (one line), before touching the bus; "" when it can."""
    if args.backend != "sim":
        return "--kv-bytes runs with --backend sim (SGLang moves its own KV)"
    try:
        import torch  # noqa: F401  # lazy: optional dependency (torch; --kv-bytes only)
    except ImportError:
        return "--kv-bytes needs torch (pip install -e '.[kv]')"
    if args.transfer == "mooncake":
        from engine.transfer.mooncake import mooncake_available  # lazy: optional dependency (torch, mooncake)

        ok, why = mooncake_available()
        if not ok:
            return f"--kv-bytes moves bytes between worker processes with Mooncake, which is missing: {why}"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(level=args.log_level, fmt=args.log_format)
    try:
        load_profile(args.profile)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"engine.worker: bad --profile: {exc}", file=sys.stderr)
        return 2
    if args.kv_bytes:
        err = _kv_bytes_preflight(args)
        if err:
            print(f"engine.worker: {err}", file=sys.stderr)
            return 2
    if args.backend in ("sglang", "vllm", "torch"):
        checks = {"sglang": check_args, "vllm": vllm_options.check_args, "torch": torch_options.check_args}
        err = checks[args.backend](args)
        if err:
            print(f"engine.worker: {err}", file=sys.stderr)
            return 2
    out = os.environ.get("EI_PROFILE_DIR")
    if not out:
        return asyncio.run(run(args))
    # a CPU profile of this worker's main thread, written at its exit (docs/experiments.md,
    # "Against the real Dynamo": how the live engines' CPU was found)
    import cProfile  # lazy: only with EI_PROFILE_DIR

    prof = cProfile.Profile(time.process_time)
    try:
        return prof.runcall(asyncio.run, run(args))
    finally:
        os.makedirs(out, exist_ok=True)
        prof.dump_stats(os.path.join(out, f"engine-{args.node}.prof"))


if __name__ == "__main__":
    exit_process(main())  # engine/transfer/exit.py: Mooncake's teardown can abort
