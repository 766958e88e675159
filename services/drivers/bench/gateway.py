"""``evolving bench gateway``: what the gateway, the bus and the router add to TTFT, beside the
engine alone, in one run (the target: p99 <= 10 ms).

One embedded ``nats-server`` on loopback (as ``evolving up`` starts it, here without accounts),
two partitions and two identical engine worker processes (``python -m engine.worker``, the sim
backend, or ``--engine torch`` with a tiny random Llama GGUF the bench writes, or ``--model``):

- **engine alone** (partition A: the engine only): the bench does what the gateway's path finally
  hands the engine: the prompt's token ids into the prompt store (torch), then
  ``RequestSubmitted`` and its ``RouteDecided`` published on the stream together, the token
  subject subscribed first; TTFT = the first token message at the bench.
- **full path** (partition B: ``python -m services.drivers.gateway`` + the router process
  ``python -m services.drivers.serve router`` + the engine): a streaming ``POST
  /v1/chat/completions`` (aiohttp, one keep-alive pool); TTFT = the first SSE chunk.

Both send the same conversations: each client is an agent branch whose turn k's prompt extends
turn k-1's (``--turns`` turns per branch, then a new branch), ``--prompt-tokens`` to start,
``--turn-tokens`` more per turn, ``--max-tokens`` output. Rounds alternate the two paths at each
``--concurrency`` (closed loop: that many clients at once).

**Paired overhead.** The bench also listens (core NATS) to both partitions' ``RequestSubmitted``,
``RouteDecided`` and token messages, so each full-path request splits into: *gateway in* (client
send -> ``RequestSubmitted`` on the bus), *router* (-> ``RouteDecided``), *engine* (-> the first
token message) and *gateway out* (-> the first chunk at the client). The request's overhead is
TTFT minus its own engine share: gateway + bus + router, paired per request.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from events import codec, wire
from events.catalog import BranchOpened, NodeRegistered, RequestSubmitted, RouteDecided
from events.hashing import block_hashes
from services.adapters.aio import wait_for
from services.adapters.bus import NatsBus
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.natsserver import EmbeddedNats, free_port
from services.adapters.bus.tokens import NatsTokens
from services.drivers.gateway.model import load_model

REPO = Path(__file__).resolve().parents[3]
TARGET_P99_MS = 10.0
BLOCK = 64


@dataclass(frozen=True, kw_only=True)
class GatewayBenchSpec:
    """``evolving bench gateway``'s options, named as its flags (:func:`add_arguments`)."""

    json: bool = False
    engine: str = "sim"  # sim, torch
    model: str | None = None  # --engine torch: a GGUF file or model folder (None: a tiny random one)
    concurrency: str = "1,8,32"  # comma-separated client counts
    requests: int = 200  # per path at each concurrency
    rounds: int = 2
    prompt_tokens: int = 512
    turn_tokens: int = 32
    turns: int = 16
    max_tokens: int = 4
    time_scale: float = 1.0
    warmup: int = 8
    py_spy: str | None = None  # folder for py-spy's collapsed stacks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--engine", choices=("sim", "torch"), default="sim",
                   help="sim backend, or the torch reference engine (a tiny random checkpoint unless --model)")
    p.add_argument("--model", default=None, help="--engine torch: a GGUF file or model folder (default: a tiny "
                                                 "random Llama GGUF written to a temporary folder)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=200, help="requests per path at each concurrency")
    p.add_argument("--rounds", type=int, default=2, help="alternations engine alone / full path per concurrency")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens of a branch's first prompt")
    p.add_argument("--turn-tokens", type=int, default=32, help="new tokens per later turn")
    p.add_argument("--turns", type=int, default=16, help="turns per branch before a client starts a new one")
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim: model seconds per wall second")
    p.add_argument("--warmup", type=int, default=8, help="requests per path before timing")
    p.add_argument("--py-spy", default=None, metavar="DIR",
                   help="record the gateway and router processes with py-spy during the timed part "
                        "(raw collapsed stacks into DIR/gateway.txt, DIR/router.txt)")


def _pct(xs, q: float) -> float:
    return round(float(np.percentile(np.asarray(xs, dtype=float), q)), 3) if len(xs) else float("nan")


def _dist(xs_ms) -> dict:
    return {"p50": _pct(xs_ms, 50), "p95": _pct(xs_ms, 95), "p99": _pct(xs_ms, 99), "n": len(xs_ms)}


def _filler(seed: str, n: int) -> str:
    """``n`` deterministic lower-case letters (one byte-level token each)."""
    out, i = [], 0
    while len(out) < n:
        out.extend(chr(97 + b % 26) for b in hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=64).digest())
        i += 1
    return "".join(out[:n])


@dataclass
class Client:
    """One agent: its current branch and conversation."""

    name: str
    turns: int
    first: int
    per_turn: int
    n_branch: int = 0
    turn: int = 0
    messages: list = field(default_factory=list)

    def next(self) -> tuple[str, list, bool]:
        """(branch, messages of this turn, whether the branch is new)."""
        new = not self.messages or self.turn >= self.turns
        if new:
            self.n_branch += 1
            self.turn = 0
            self.messages = [{"role": "user", "content": _filler(f"{self.name}.{self.n_branch}", self.first)}]
        else:
            self.messages += [{"role": "assistant", "content": "ok"},
                              {"role": "user", "content": _filler(f"{self.name}.{self.n_branch}.{self.turn}",
                                                                  self.per_turn)}]
        self.turn += 1
        return f"{self.name}.{self.n_branch}", list(self.messages), new


class Observer:
    """Arrival times (bench clock) of each request's RequestSubmitted, RouteDecided and first token."""

    def __init__(self) -> None:
        self.sub: dict[str, float] = {}
        self.route: dict[str, float] = {}
        self.tok: dict[str, float] = {}

    async def start(self, bus) -> None:
        async def on_event(msg) -> None:
            t = time.perf_counter()
            try:
                ev = codec.decode_message(msg.data, msg.headers)
            except Exception:  # noqa: BLE001 - not an event this bench follows
                return
            if isinstance(ev, RequestSubmitted):
                self.sub.setdefault(ev.request, t)
            elif isinstance(ev, RouteDecided) and not ev.shadow:
                self.route.setdefault(ev.request, t)

        async def on_token(msg) -> None:
            t = time.perf_counter()
            self.tok.setdefault(wire.decode(msg.data).request, t)

        await bus.listen("ei.*.agent.>", on_event)  # every partition's: one connection sees them all
        await bus.listen("ei.*.route", on_event)
        await bus.listen("eitok.*.>", on_token)


@dataclass
class Sample:
    path: str
    concurrency: int
    ttft_ms: float
    request: str
    t0: float


class Bench:
    def __init__(self, spec: GatewayBenchSpec, workdir: Path) -> None:
        self.spec, self.dir = spec, workdir
        run = f"{os.getpid()}x{int(time.time() * 1000) % 100000}"
        self.pa, self.pb = f"bgwa{run}", f"bgwb{run}"
        self.procs: list[subprocess.Popen] = []
        self.obs = Observer()
        self.model_path: str | None = None
        self.errors: list[str] = []
        self.cpu: dict[int, dict[str, float]] = {}  # concurrency -> CPU seconds during the full-path phases

    # ------------------------------------------------------------------ the stack
    def _model(self) -> str | None:
        if self.spec.engine != "torch":
            return None
        if self.spec.model:
            return self.spec.model
        from engine.backends.torch.loader import (  # lazy: optional dependency (torch)
            LlamaConfig,
            byte_vocab,
            random_weights,
            write_gguf,
        )

        cfg = LlamaConfig(vocab=384, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, rope_base=10000.0,
                          max_pos=4096)
        path = self.dir / "tiny-llama.gguf"
        write_gguf(path, cfg, random_weights(cfg, seed=3), tokens=byte_vocab(cfg.vocab))
        return str(path)

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("EI_TOKENIZER", None)
        with open(self.dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen([sys.executable, "-m", *cmd], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    async def start(self, url: str) -> None:
        self.model_path = self._model()
        eng = ["--backend", "torch", "--model", self.model_path, "--prompt-store", "on"] if self.model_path else \
            ["--time-scale", str(self.spec.time_scale)]
        for node, part in (("a0", self.pa), ("b0", self.pb)):
            self._spawn(f"engine-{node}", ["engine.worker", "--node", node, "--nats-url", url, "--partition", part,
                                           "--log-format", "json", *eng])
        self.bus_a = await NatsBus.connect(url, partition=self.pa, name="bench-a")
        self.bus_b = await NatsBus.connect(url, partition=self.pb, name="bench-b")
        self.router = self._spawn("router", ["services.drivers.serve", "router", "--nats-url", url,
                                             "--partition", self.pb])
        self.port = free_port()
        gw = ["--tokenizer", self.model_path, "--prompt-store", "on"] if self.model_path else []
        self.gateway = self._spawn("gateway", ["services.drivers.gateway", "--nats-url", url, "--partition", self.pb,
                                "--port", str(self.port), "--log-format", "json", *gw])
        self.base = f"http://127.0.0.1:{self.port}"
        self.tokens_a = NatsTokens.from_bus(self.bus_a)
        self.store_a = NatsPromptStore.from_bus(self.bus_a, replicas=1) if self.model_path else None
        self.model = load_model(self.model_path)
        await self.obs.start(self.bus_a)
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=120))
        await self._ready()
        (self.dir / "pids.json").write_text(json.dumps({"gateway": self.gateway.pid, "router": self.router.pid}))

    async def _ready(self) -> None:
        async def registered(bus) -> bool:
            if await bus.last_seq() == 0:
                return False
            async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.node.>") as c:
                it = c.__aiter__()
                try:
                    return isinstance((await wait_for(it.__anext__(), 2.0)).event, NodeRegistered)
                except (TimeoutError, StopAsyncIteration):
                    return False

        async def up() -> bool:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a child exited ({p.args[2:4]}, rc {p.returncode}); logs in {self.dir}")
            try:
                async with self.http.get(self.base + "/health") as r:
                    ok = r.status == 200
            except aiohttp.ClientError:
                return False
            return (ok and await self.bus_b.get_snapshot("config.router") is not None
                    and await registered(self.bus_a) and await registered(self.bus_b))

        deadline = time.monotonic() + (600 if self.model_path else 120)
        while not await up():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engines, router and gateway did not come up; logs in {self.dir}")
            await asyncio.sleep(0.3)

    def spy(self, out: str) -> list[subprocess.Popen]:
        """py-spy on the gateway and the router until :meth:`stop` (SIGINT makes it write)."""
        Path(out).mkdir(parents=True, exist_ok=True)
        exe = Path(sys.executable).with_name("py-spy")
        spies = [subprocess.Popen([str(exe), "record", "-p", str(p.pid), "-r", "250", "-f", "raw", "--nonblocking",
                                   "-o", str(Path(out) / f"{name}.txt")], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
                 for name, p in (("gateway", self.gateway), ("router", self.router))]
        self.procs[:0] = spies  # stopped first
        return spies

    async def stop(self) -> None:
        if getattr(self, "http", None):
            await self.http.close()
        spies = [p for p in self.procs if "py-spy" in str(p.args[0])]
        for group, sig in ((spies, signal.SIGINT), ([p for p in self.procs if p not in spies], signal.SIGTERM)):
            for p in group:  # py-spy first: SIGINT makes it write its file while its target still runs
                if p.poll() is None:
                    p.send_signal(sig)
            for p in group:
                try:
                    await wait_for(asyncio.to_thread(p.wait), 15)
                except TimeoutError:
                    p.kill()
        for b in (getattr(self, "bus_a", None), getattr(self, "bus_b", None)):
            if b is not None:
                await b.close()

    # ------------------------------------------------------------------ the two paths
    async def engine_alone(self, cl: Client, n: int, conc: int) -> Sample:
        branch, messages, new = cl.next()
        branch = f"a-{branch}"
        if new:
            await self.bus_a.publish(BranchOpened(ts=time.time(), src="bench", branch=branch, session=branch))
        ids = self.model.tokenizer.encode(self.model.template.render(messages))
        rid = f"{branch}/a-{n}"
        t0 = time.perf_counter()
        tsub = await self.tokens_a.subscribe(rid)
        try:
            if self.store_a is not None:
                await self.store_a.put(rid, ids)
            now = time.time()
            await self.bus_a.publish_many([
                RequestSubmitted(ts=now, src="bench", request=rid, branch=branch, blocks=block_hashes(ids, BLOCK),
                                 prompt_tokens=len(ids), max_tokens=self.spec.max_tokens, block_tokens=BLOCK),
                RouteDecided(ts=now, src="bench", request=rid, prefill_node="a0", decode_node="a0", policy="bench")])
            while True:
                m = await tsub.get(60)
                if m.kind == "error":
                    raise RuntimeError(m.error)
                if m.kind in ("first", "chunk", "done"):
                    break
            ttft = time.perf_counter() - t0
            while m.kind not in ("done", "error"):
                m = await tsub.get(60)
        finally:
            await tsub.close()
        return Sample("engine", conc, ttft * 1e3, rid, t0)

    async def full_path(self, cl: Client, n: int, conc: int) -> Sample:
        branch, messages, _new = cl.next()
        body = {"messages": messages, "max_tokens": self.spec.max_tokens, "stream": True,
                "ignore_eos": True}  # every answer max_tokens long, whatever the engine's end of turn
        t0 = time.perf_counter()
        async with self.http.post(self.base + "/v1/chat/completions", json=body,
                                  headers={"x-branch-id": f"b-{branch}"}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            ttft = None
            async for line in r.content:
                if ttft is None and line.startswith(b"data: "):
                    ttft = time.perf_counter() - t0
            rid = r.headers.get("x-request-id", "")
        return Sample("gateway", conc, ttft * 1e3, rid, t0)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds the gateway and router processes have used so far: the sum of their
        threads' on-CPU nanoseconds (``/proc/PID/task/TID/schedstat``), else user + system
        from ``/proc/PID/stat``. The latter counts in clock ticks (10 ms here): a short phase
        of 4 requests read 0.0 ms of gateway CPU in CI."""
        return {name: _proc_cpu_s(p.pid) for name, p in (("gateway", self.gateway), ("router", self.router))}

    async def phase(self, path: str, clients: list[Client], per_client: int, conc: int, out: list, bar) -> None:
        fn = self.engine_alone if path == "engine" else self.full_path

        async def one(cl: Client) -> None:
            for i in range(per_client):
                try:
                    out.append(await fn(cl, i, conc))
                except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
                    self.errors.append(f"{path} c={conc}: {type(exc).__name__}: {exc}"[:300])
                if bar is not None:
                    bar()

        await asyncio.gather(*(one(c) for c in clients))


def _row(b: Bench, conc: int, samples: list[Sample]) -> dict:
    eng = [s for s in samples if s.path == "engine" and s.concurrency == conc]
    gw = [s for s in samples if s.path == "gateway" and s.concurrency == conc]
    o = b.obs
    split = {"gateway_in": [], "router": [], "engine": [], "gateway_out": [], "overhead": []}
    for s in gw:
        ts, tr, tt = o.sub.get(s.request), o.route.get(s.request), o.tok.get(s.request)
        if None in (ts, tr, tt):
            continue
        t1 = s.t0 + s.ttft_ms / 1e3
        split["gateway_in"].append((ts - s.t0) * 1e3)
        split["router"].append((tr - ts) * 1e3)
        split["engine"].append((tt - tr) * 1e3)
        split["gateway_out"].append((t1 - tt) * 1e3)
        split["overhead"].append(s.ttft_ms - (tt - tr) * 1e3)
    eng_engine = [(o.tok[s.request] - o.route[s.request]) * 1e3 for s in eng
                  if s.request in o.tok and s.request in o.route]
    a, g = _dist([s.ttft_ms for s in eng]), _dist([s.ttft_ms for s in gw])
    cpu = {f"{k}_cpu_ms_per_request": round(v * 1e3 / max(1, len(gw)), 3) for k, v in b.cpu.get(conc, {}).items()}
    return {"concurrency": conc, **cpu, "engine_alone_ttft_ms": a, "full_path_ttft_ms": g,
            "difference_ms": {k: round(g[k] - a[k], 3) for k in ("p50", "p95", "p99")},
            "paired_overhead_ms": _dist(split["overhead"]),
            "split_ms": {k: _dist(v) for k, v in split.items() if k != "overhead"},
            "engine_alone_engine_share_ms": _dist(eng_engine)}


async def run(spec: GatewayBenchSpec, progress=None) -> dict:
    concs = [int(x) for x in spec.concurrency.split(",") if x]
    workdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    srv = EmbeddedNats().start()
    b = Bench(spec, workdir)
    samples: list[Sample] = []
    try:
        await b.start(srv.url)
        for path in ("engine", "gateway"):  # warm-up: imports, first calls, the router's first fits
            await b.phase(path, [Client(f"w{path}", spec.turns, spec.prompt_tokens, spec.turn_tokens)],
                          spec.warmup, 0, [], None)
        if spec.py_spy:
            b.spy(spec.py_spy)
        total = len(concs) * 2 * spec.requests
        bar = progress(total) if progress else None
        for conc in concs:
            per = max(1, spec.requests // (spec.rounds * conc))
            clients = {p: [Client(f"c{conc}{p[0]}{i}", spec.turns, spec.prompt_tokens, spec.turn_tokens)
                           for i in range(conc)] for p in ("engine", "gateway")}
            cpu = {"gateway": 0.0, "router": 0.0}
            for _ in range(spec.rounds):
                for path in ("engine", "gateway"):
                    c0 = b.cpu_s()
                    await b.phase(path, clients[path], per, conc, samples, bar)
                    if path == "gateway":
                        c1 = b.cpu_s()
                        cpu = {k: cpu[k] + c1[k] - c0[k] for k in cpu}
            b.cpu[conc] = cpu
        await asyncio.sleep(0.5)  # the observer's last messages
        rows = [_row(b, c, samples) for c in concs]
    finally:
        await b.stop()
        srv.stop()
    worst = max((r["paired_overhead_ms"]["p99"] for r in rows), default=float("nan"))
    return {"engine": spec.engine, "model": b.model_path or "sim (gb300-glm52 profile)",
            "prompt_tokens": spec.prompt_tokens, "turn_tokens": spec.turn_tokens, "turns": spec.turns,
            "max_tokens": spec.max_tokens, "requests_per_path": spec.requests, "rounds": spec.rounds,
            "rows": rows, "target_p99_ms": TARGET_P99_MS, "worst_paired_p99_ms": worst,
            "meets_target": bool(worst <= TARGET_P99_MS), "errors": b.errors[:20], "n_errors": len(b.errors),
            "load_avg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(), "logs": str(workdir)}


def format_report(r: dict) -> str:
    lines = [(f"gateway overhead on TTFT: {r['engine']} engine ({r['model']}), prompts {r['prompt_tokens']} tokens "
             f"+{r['turn_tokens']}/turn, {r['max_tokens']} output tokens, {r['requests_per_path']} requests per path "
             f"per concurrency; load {r['load_avg']} on {r['cpus']} CPUs"),
             f"{'conc':>4} {'path':<22}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"]
    for row in r["rows"]:
        c = row["concurrency"]
        for name, d in (("engine alone", row["engine_alone_ttft_ms"]), ("gateway+bus+router", row["full_path_ttft_ms"]),
                        ("difference", row["difference_ms"]), ("paired overhead", row["paired_overhead_ms"])):
            lines.append(f"{c:>4} {name:<22}{d['p50']:>9.2f}{d['p95']:>9.2f}{d['p99']:>9.2f}")
        sp = row["split_ms"]
        lines.append("     split p50/p99: " + ", ".join(f"{k} {v['p50']:.2f}/{v['p99']:.2f}" for k, v in sp.items()))
        if "gateway_cpu_ms_per_request" in row:
            lines.append(f"     CPU per request: gateway {row['gateway_cpu_ms_per_request']:.2f} ms, "
                         f"router {row['router_cpu_ms_per_request']:.2f} ms")
    lines.append(f"target: paired overhead p99 <= {r['target_p99_ms']:g} ms: worst {r['worst_paired_p99_ms']:.2f} ms "
                 f"-> {'met' if r['meets_target'] else 'NOT met'}; errors {r['n_errors']}")
    return "\n".join(lines)


async def _main(spec: GatewayBenchSpec, progress) -> dict:
    """:func:`run`, cancelled by SIGTERM / SIGINT so its children are stopped, not left behind."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    return await run(spec, progress)


def main(spec: GatewayBenchSpec) -> int:
    if spec.engine == "torch":
        try:
            import torch  # noqa: F401  # lazy: optional dependency (torch)
        except ImportError:
            print("evolving bench gateway --engine torch needs torch: pip install -e '.[engine]'", file=sys.stderr)
            return 2
    show = not spec.json and sys.stderr.isatty()
    if show:
        from rich.progress import Progress  # lazy: start-up (rich ~60 ms), only on a terminal

        ctx = Progress(transient=True)
    else:
        ctx = nullcontext(None)
    with ctx as bar:
        def progress(total: int):
            task = bar.add_task("requests (engine alone, then full path, per concurrency)", total=total)
            return lambda: bar.advance(task)

        r = asyncio.run(_main(spec, progress if bar is not None else None))
    print(json.dumps(r, indent=2) if spec.json else format_report(r))
    return 0 if not r["n_errors"] else 1


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (see ``Bench.cpu_s``); NaN when it is gone. The
    schedstat sum covers the threads alive now: one that exits between two readings takes its
    time with it (the gateway's and router's threads live as long as they do)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")
