"""``evolving bench live``: the live path over a real nats-server, measured side by side.

1. **Route decision latency** at ``--rate`` requests/s: the router runs as its own process
   (``python -m services.drivers.serve router``); the bench publishes ``RequestSubmitted`` (JetStream publish,
   acked) and times until the request's ``RouteDecided`` arrives on a core-NATS subscription
   to the route subject. Target p99 <= 5 ms at 100 req/s. Beside it: the router core alone on
   the same stream, one publish round trip, and the same path with the ``round_robin`` router.
2. **Directory fold rate vs raw consume rate**, same events, same process, one after the
   other: a durable consumer that only iterates and acks (the JetStream ceiling of this
   client), then the directory service folding the same stream from sequence 1 (decode, fold,
   ack, anomalies published). Target ratio >= 0.5.
3. **Recorder**: the recorder service landing the same stream into a fresh DuckDB file.
4. **Gateway**: sustained completed requests/s through gateway -> router -> sim engines
   (``evolving up`` as a child process, ``--gateway-requests`` short requests at a fixed
   concurrency), when the gateway and the engine worker are present.

Figures are wall-clock and machine-dependent; the ratio in 2 is the comparable one.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from events import codec
from events.catalog import KvStored, RequestSubmitted, Tick
from services.adapters.aio import wait_for
from services.adapters.bus import Bus, NatsBus
from services.adapters.bus.natsserver import EmbeddedNats
from services.adapters.plugins import load_router
from services.adapters.runner import RunnerConfig, ServiceRunner
from services.cores.directory.core import DirectoryCore
from services.drivers.bench import harness as workload
from services.drivers.options import ServiceOptions
from services.drivers.serve import build_runner, run_recorder_service
from services.drivers.up.testing import read_all, spawn_service, wait_until

REPO = Path(__file__).resolve().parents[3]
_RUN = f"{os.getpid()}x{int(time.time() * 1000) % 100000}"


def _partition(kind: str) -> str:
    """A partition of its own for each section of each run (a reused server keeps old streams)."""
    return f"bench{kind}{_RUN}"


def _pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs), q)), 3) if xs else float("nan")


# ------------------------------------------------------------------------------ 1. route latency
async def route_latency(url: str, rate: float, n: int, router_name: str = "evolving") -> dict:
    part = _partition(f"lat{router_name.replace('_', '')}")
    bus = await NatsBus.connect(url, part)
    await bus.publish_many(workload.nodes(4, 4))
    n_branches = 50
    for b in range(n_branches):
        await bus.publish_many(workload.branch_events(b, 0, prefix="lat"))
    log_path = Path(tempfile.gettempdir()) / f"{part}-router.log"
    router = spawn_service("router", url, part, "--router", router_name, "--snapshot-interval-s", "5",
                           log_path=log_path)
    arrived: dict[str, float] = {}

    async def on_route(msg) -> None:
        ev = codec.decode_message(msg.data, msg.headers)
        if not ev.reroute:
            arrived.setdefault(ev.request, time.perf_counter())

    sub = await bus.listen(f"ei.{part}.route", on_route)
    try:
        async def started() -> bool:
            return await bus.get_snapshot("config.router") is not None

        await wait_until(started, 60, what="the router process")
        # warm-up: the first decisions pay imports and JIT-free first calls
        warm = [f"warm/{i}" for i in range(20)]
        for i, rid in enumerate(warm):
            await bus.publish(RequestSubmitted(ts=time.time(), src="bench", request=rid, branch=f"lat{i % n_branches}",
                                               blocks=[i * 7919 + j for j in range(8)], prompt_tokens=600,
                                               max_tokens=32))

        async def warmed() -> bool:
            return all(r in arrived for r in warm)

        await wait_until(warmed, 60, what="warm-up decisions")
        sent: dict[str, float] = {}
        period = 1.0 / rate
        t_next = time.perf_counter()
        t0 = t_next
        for i in range(n):
            now = time.perf_counter()
            if t_next > now:
                await asyncio.sleep(t_next - now)
            t_next += period
            rid = f"req/{i}"
            b = i % n_branches
            k = i // n_branches
            blocks = [(b + 1) * 1_000_003 * 131 + j for j in range(4 * (k + 1))]  # growing shared prefix
            sent[rid] = time.perf_counter()
            await bus.publish(RequestSubmitted(ts=time.time(), src="bench", request=rid, branch=f"lat{b}",
                                               blocks=blocks, prompt_tokens=len(blocks) * 64 + 20, max_tokens=64))

        async def all_in() -> bool:
            return all(r in arrived for r in sent)

        await wait_until(all_in, 60, what="every decision")
        elapsed = time.perf_counter() - t0
        floor_ms = await _publish_rtt_ms(bus, rate, min(n, 300))
        lat_ms = [(arrived[r] - sent[r]) * 1e3 for r in sent]
        core_ms, core_cpu_ms = _router_core_ms(await _stream_events(bus), router_name)
    finally:
        await sub.close()
        await _stop_process(router)
        await bus.close()
    return {"rate_rps": rate, "requests": n, "achieved_rps": round(n / elapsed, 1),
            "p50_ms": _pct(lat_ms, 50), "p90_ms": _pct(lat_ms, 90), "p99_ms": _pct(lat_ms, 99),
            "max_ms": round(max(lat_ms), 3), "target_p99_ms": 5.0, "router": f"{router_name} (own process)",
            "core_only_p50_ms": _pct(core_ms, 50), "core_only_p99_ms": _pct(core_ms, 99),
            "core_only_cpu_p50_ms": _pct(core_cpu_ms, 50), "core_only_cpu_p99_ms": _pct(core_cpu_ms, 99),
            "publish_rtt_p50_ms": _pct(floor_ms, 50), "publish_rtt_p99_ms": _pct(floor_ms, 99)}


async def _stop_process(proc, timeout_s: float = 20.0, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        await wait_for(asyncio.to_thread(proc.wait), timeout_s)
    except TimeoutError:
        proc.kill()
        await asyncio.to_thread(proc.wait)


async def _until_applied(runner, task, head: int, timeout_s: float = 300.0) -> None:
    """Wait until ``runner`` folded ``head``; fail loudly if its task ended or time ran out."""
    deadline = time.perf_counter() + timeout_s
    while runner.applied_seq < head:
        if task.done():
            task.result()
            raise RuntimeError(f"{runner.cfg.name} stopped at {runner.applied_seq} of {head}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{runner.cfg.name} folded {runner.applied_seq} of {head} in {timeout_s} s")
        await asyncio.sleep(0.002)


async def _publish_rtt_ms(bus: NatsBus, rate: float, n: int) -> list[float]:
    """One JetStream publish round trip (publish until the server's ack), at the same rate:
    the floor of one hop; a routed request makes three (publish, delivery to the router,
    the router's publish reaching the subscriber)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await bus.publish(Tick(ts=time.time(), src="bench"))  # a valid event: the router folds it
        out.append((time.perf_counter() - t) * 1e3)
        await asyncio.sleep(1.0 / rate)
    return out


async def _stream_events(bus: Bus) -> list:
    return [d.event for d in await read_all(bus)]


def _router_core_ms(events: list, router_name: str) -> tuple[list[float], list[float]]:
    """The same stream folded through a fresh router in this process: the wall time and the CPU
    time of the thread (``time.thread_time``) of each ``RequestSubmitted`` fold alone (no
    transport), for the side-by-side figure. A wall p99 far above the CPU p99 is this process
    waiting for a core (a loaded machine), not the decision's own work."""
    router = load_router(router_name)()
    wall, cpu = [], []
    for ev in events:
        t, c = time.perf_counter(), time.thread_time()
        router.apply(ev)
        if isinstance(ev, RequestSubmitted) and ev.request.startswith("req/"):
            cpu.append((time.thread_time() - c) * 1e3)
            wall.append((time.perf_counter() - t) * 1e3)
    return wall, cpu


# ------------------------------------------------------------------------------ 2+3. fold rates
class _NoopCore:
    """A core that folds nothing: measures the runner's own cost per event."""

    name = "noop"

    def apply(self, event) -> list:
        return []

    def snapshot(self) -> bytes:
        return b""

    @classmethod
    def from_snapshot(cls, data: bytes) -> _NoopCore:
        return cls()


def fold_events(n_events: int) -> list:
    """A mix like a live run's: harness events, KV stores on four nodes."""
    out = list(workload.nodes(2, 2, ts=0.0))
    b = 0
    while len(out) < n_events:
        evs = workload.branch_events(b, 4, ts=float(b), blocks_per_request=8, prefix="f")
        out.extend(evs)
        for ev in evs:
            if isinstance(ev, RequestSubmitted):
                node = f"p{b % 2}"
                out.append(KvStored(ts=ev.ts, src="bench", node=node, tier="L1", blocks=ev.blocks,
                                    request=ev.request, branch=ev.branch))
        b += 1
    return out[:n_events]


async def fold_rates(url: str, n_events: int) -> dict:
    part = _partition("fold")
    bus = await NatsBus.connect(url, part)
    events = fold_events(n_events)
    for i in range(0, len(events), 5000):
        await bus.publish_many(events[i:i + 5000])
    head = await bus.last_seq()

    # the directory core alone, in memory (no transport): the other bound of the fold rate
    core = DirectoryCore()
    t0 = time.perf_counter()
    for ev in events:
        core.apply(ev)
    core_s = time.perf_counter() - t0
    n_core = len(events)
    # a service process holds neither the published events (30k+ lists of blocks) nor a second
    # core: dropped here, so the cyclic GC does not rescan them inside the timed sections
    del events, core
    gc.collect()

    # raw consume: iterate + ack, nothing else
    async def consume() -> None:
        async with bus.consumer("bench-raw", start_seq=1) as c:
            async for d in c:
                await c.ack(d.seq)
                if d.seq >= head:
                    break

    # CPU time of this process beside wall clock: on a shared machine the wall-clock rates
    # mostly measure how much of a core the bench got (the nats-server runs beside it)
    t0, c0 = time.perf_counter(), time.process_time()
    await wait_for(consume(), 300)
    raw_s, raw_cpu = time.perf_counter() - t0, time.process_time() - c0

    # the same runner around a core that does nothing: the adapter's own cost
    noop = ServiceRunner(bus, RunnerConfig(name="bench-noop", config={}, snapshot_every=10**9,
                                           snapshot_interval_s=10**6), _NoopCore, _NoopCore.from_snapshot)
    nstop = asyncio.Event()
    t0, c0 = time.perf_counter(), time.process_time()
    ntask = asyncio.create_task(noop.run(nstop))
    await _until_applied(noop, ntask, head)
    noop_s, noop_cpu = time.perf_counter() - t0, time.process_time() - c0
    nstop.set()
    await ntask

    # directory service: decode, fold, publish anomalies, ack
    runner = build_runner("directory", ServiceOptions.of("directory", snapshot_every=10**9, snapshot_interval_s=10**6), bus)
    stop = asyncio.Event()
    t0, c0 = time.perf_counter(), time.process_time()
    task = asyncio.create_task(runner.run(stop))
    await _until_applied(runner, task, head)
    fold_s, fold_cpu = time.perf_counter() - t0, time.process_time() - c0
    stop.set()
    await task
    anomalies = int(runner.metrics.total("ei_service_anomalies_total"))

    # recorder service into a fresh DuckDB file
    with tempfile.TemporaryDirectory() as tmp:
        rec = ServiceOptions.of("recorder", db=os.path.join(tmp, "bench.duckdb"), run_config=None,
                                flush_interval_s=0.2, drain_timeout_s=60.0)
        rstop = asyncio.Event()
        t0 = time.perf_counter()
        rtask = asyncio.create_task(run_recorder_service(rec, bus, rstop))
        rstop.set()  # the drain waits until the log holds the head seen now
        stats = await rtask
        rec_s = time.perf_counter() - t0
    await bus.close()
    return {"events": head, "raw_consume_eps": round(head / raw_s), "directory_fold_eps": round(head / fold_s),
            "ratio": round(raw_s / fold_s, 3), "target_ratio": 0.5, "directory_anomalies": anomalies,
            "raw_consume_cpu_eps": round(head / raw_cpu), "directory_fold_cpu_eps": round(head / fold_cpu),
            "ratio_cpu": round(raw_cpu / fold_cpu, 3), "runner_noop_core_cpu_eps": round(head / noop_cpu),
            "directory_core_only_eps": round(n_core / core_s),
            "runner_noop_core_eps": round(head / noop_s),
            "serial_bound_ratio": round(raw_s / (raw_s + core_s), 3),
            "recorder_eps": round(stats.recorded / rec_s), "recorded": stats.recorded}


# ------------------------------------------------------------------------------ 4. gateway
async def gateway_throughput(url: str, n: int, concurrency: int = 32) -> dict:
    missing = [m for m in ("engine.worker", "services.drivers.gateway.app") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"missing {missing}: router path only (section 1)"}

    part = _partition("gw")
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        up = subprocess.Popen([sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", url, "--partition", part,  # noqa: ASYNC220 - Popen returns at once
                               "--run-dir", tmp, "--engines", "4", "--prefill", "2", "--gateway-port", "0",
                               "--ready-file", str(ready), "--no-status", "--metrics-port", "-1"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                if time.monotonic() > deadline or up.poll() is not None:
                    return {"skipped": "evolving up did not become ready"}
                await asyncio.sleep(0.2)
            gw = json.loads(ready.read_text())["gateway"]
            ok = failed = 0
            lat: list[float] = []
            sem = asyncio.Semaphore(concurrency)

            async def one(http, i: int) -> None:
                nonlocal ok, failed
                async with sem:
                    t = time.perf_counter()
                    body = {"model": "evolving-sim", "prompt": f"bench {i % 16} " + "x" * 256, "max_tokens": 8}
                    hdrs = {"x-branch-id": f"bench-{i}", "x-branch-end": "true"}
                    try:
                        async with http.post(f"{gw}/v1/completions", json=body, headers=hdrs) as r:
                            await r.read()
                            if r.status == 200:
                                ok += 1
                                lat.append(time.perf_counter() - t)
                            else:
                                failed += 1
                    except aiohttp.ClientError:
                        failed += 1

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                await asyncio.gather(*(one(http, i) for i in range(min(16, n))))  # warm-up
                ok = failed = 0
                lat.clear()
                t0 = time.perf_counter()
                await asyncio.gather(*(one(http, 1000 + i) for i in range(n)))
                wall = time.perf_counter() - t0
        finally:
            await _stop_process(up, 60.0, signal.SIGINT)
    return {"requests": n, "concurrency": concurrency, "ok": ok, "failed": failed,
            "completed_rps": round(ok / wall, 1), "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
            "engines": "4 sim (2 prefill, 2 decode), time scale 1", "max_tokens": 8}


# ------------------------------------------------------------------------------ driver
@dataclass(frozen=True, kw_only=True)
class LiveBenchSpec:
    """``evolving bench live``'s options, named as its flags (services/drivers/up/cli.py)."""

    nats_url: str | None = None  # None: an embedded nats-server
    rate: float = 100.0  # requests/s of the route latency test
    requests: int = 1000
    fold_events: int = 50000
    gateway_requests: int = 200  # 0: skip the gateway row


async def run(spec: LiveBenchSpec) -> dict:
    nats = None
    url = spec.nats_url
    if url is None:
        nats = EmbeddedNats().start()
        url = nats.url
    try:
        res: dict = {"cpus": os.cpu_count(), "loadavg_1m_before": round(os.getloadavg()[0], 2)}
        res["route_latency"] = await route_latency(url, spec.rate, spec.requests)
        res["route_latency_round_robin"] = await route_latency(url, spec.rate, spec.requests, "round_robin")
        res["fold"] = await fold_rates(url, spec.fold_events)
        if spec.gateway_requests > 0:
            res["gateway"] = await gateway_throughput(url, spec.gateway_requests)
        res["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        return res
    finally:
        if nats is not None:
            nats.stop()


def print_report(res: dict) -> None:
    print(f"{res['cpus']} CPUs, 1-minute load average {res['loadavg_1m_before']} before, "
          f"{res['loadavg_1m_after']} after (other processes on the machine stretch the tails)")
    r = res["route_latency"]
    print(f"route decision over NATS ({r['router']}), {r['requests']} requests at {r['rate_rps']:g} req/s "
          f"(achieved {r['achieved_rps']}):")
    print(f"  p50 {r['p50_ms']} ms   p90 {r['p90_ms']} ms   p99 {r['p99_ms']} ms   max {r['max_ms']} ms   "
          f"(target p99 <= {r['target_p99_ms']:g} ms: {'met' if r['p99_ms'] <= r['target_p99_ms'] else 'MISSED'})")
    print(f"  the router core alone on the same stream: p50 {r['core_only_p50_ms']} ms   p99 {r['core_only_p99_ms']} ms"
          f"   (CPU time: p50 {r['core_only_cpu_p50_ms']} ms   p99 {r['core_only_cpu_p99_ms']} ms)")
    print(f"  one JetStream publish round trip (one of the three hops): p50 {r['publish_rtt_p50_ms']} ms   "
          f"p99 {r['publish_rtt_p99_ms']} ms")
    b = res.get("route_latency_round_robin")
    if b:
        print(f"  baseline, same path with the round_robin router: p50 {b['p50_ms']} ms   p90 {b['p90_ms']} ms   "
              f"p99 {b['p99_ms']} ms (its core: p99 {b['core_only_p99_ms']} ms)")
    f = res["fold"]
    print(f"fold, {f['events']} events on one stream:")
    print(f"  raw JetStream consume+ack  {f['raw_consume_eps']:>9,} events/s")
    print(f"  directory service fold     {f['directory_fold_eps']:>9,} events/s   ratio {f['ratio']} "
          f"(target >= {f['target_ratio']}: {'met' if f['ratio'] >= f['target_ratio'] else 'MISSED'})")
    print(f"  runner, a no-op core       {f['runner_noop_core_eps']:>9,} events/s   (the adapter's own cost)")
    if "ratio_cpu" in f:
        print(f"  same, CPU time of this process: raw {f['raw_consume_cpu_eps']:,}, fold "
              f"{f['directory_fold_cpu_eps']:,}, no-op runner {f['runner_noop_core_cpu_eps']:,} events/s; "
              f"ratio {f['ratio_cpu']}")
    print(f"  directory core alone       {f['directory_core_only_eps']:>9,} events/s   (in memory; serial bound of "
          f"the ratio in one Python thread: {f['serial_bound_ratio']})")
    print(f"  recorder into DuckDB       {f['recorder_eps']:>9,} events/s")
    g = res.get("gateway")
    if g is None:
        return
    if "skipped" in g:
        print(f"gateway: skipped ({g['skipped']})")
        return
    print(f"gateway -> router -> sim engines ({g['engines']}), {g['requests']} requests, concurrency "
          f"{g['concurrency']}, max_tokens {g['max_tokens']}:")
    print(f"  {g['completed_rps']} completed req/s   ok {g['ok']}  failed {g['failed']}   "
          f"latency p50 {g['latency_p50_s']} s  p99 {g['latency_p99_s']} s")
