"""``evolving bench dynamo --live``: the real NVIDIA Dynamo serving (its frontend, KV router and
mocker workers, ai-dynamo 1.6.1) and ``evolving up`` side by side, the same client on the same
trace, the same engine model and capacity (docs/experiments.md, "Against the
real Dynamo", Live).

1. The trace: the offline part's Mooncake file (:func:`~services.drivers.bench.dynamo.write_trace`:
   the first ``--sessions`` bundled sessions, each cut to ``--turns`` requests, paced).
2. The engine: both sides run :func:`~services.drivers.bench.dynamo_model.equalised_profile` of
   ``--profile``: Dynamo's ``python -m dynamo.mocker --num-workers N --extra-engine-args`` gets the
   offline part's NPZ and limits (aggregated workers); ours gets the same profile as a TOML file
   (``evolving up --engines N --profile FILE``, collocated engines). Engine time runs at model
   speed on both (``--speedup-ratio`` = ``--time-scale`` = 1 by default). One context limit on
   both: the mocker's ``max_model_len`` is the gateway's ``context_length`` (262,144 tokens), so
   the few longer requests of the bundled sessions are refused by both sides (counted as errors).
3. The client: ``evolving drive``'s :class:`~services.drivers.gateway.drive.Driver` (closed loop,
   ``--concurrency`` sessions at a time, pauses divided by ``--speedup``), prompts as token ids
   of the bundled SmolLM2 vocabulary (``DriveConfig.token_ids``: each trace block's 64 ids from
   its hash, so both sides see the trace's lengths and shared prefixes exactly), ``/v1/completions``
   streaming with ``ignore_eos`` (the recorded output length). aiperf is not used: its
   ``mooncake_trace`` replays rows by timestamp or at a fixed concurrency, not sessions whose next
   turn waits for the previous answer, and it tokenises text prompts on both sides.
4. CPU: utime + stime (``/proc/PID/stat``) of every process of each stack (the process tree of
   ``evolving up``; Dynamo's frontend and mocker trees), read when the stack is ready and after
   the trace, so start-up and the overhead probe are not counted; per request = CPU seconds /
   requests answered, split by process role. Before the trace, the idle stack's CPU over
   ``--idle-s`` (ms per wall second, by role): the part of the per-request figure that is the
   stack's background (heartbeats, ticks, the recorder's flushes) rather than the requests.
5. Gateway overhead: ``--overhead-requests`` requests of ``max_tokens`` 1, streaming, a fresh
   64-token prompt each (no cache hit), at 1 and 8 clients: TTFT P50 / P99, and the same minus
   the model's prefill of that prompt (eq. 1, identical on both sides), which is what the serving
   path adds.

``--json``: ``{"rows": [{"mode": "live", "stack", "metric", "value"}]}``, stack ``dynamo`` for the
real one, ``evolving`` for ``evolving up``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from engine.profiles import PROFILE_DIR, Profile, load_profile
from replay.traces.importers.spec import load_workload
from services.drivers.bench.dynamo import DYNAMO_PYTHON, ROOT, OfflineSpec, dynamo_missing, write_trace
from services.drivers.bench.dynamo_model import equalised_profile, mocker_engine_args, write_mocker_npz
from services.drivers.gateway.config import GatewayConfig
from services.drivers.gateway.drive import DriveConfig, Driver, DriveReport, synth_ids

MODEL = "evolving-sim"
VOCAB = 49_152  # SmolLM2's, the tokenizer folder both sides load (Dynamo's needs one; ours hashes ids)
CLK_TCK = os.sysconf("SC_CLK_TCK")
LIVE_METRICS = ("throughput_rps", "ttft_p50_s", "ttft_p95_s", "e2e_mean_s", "e2e_p95_s", "kv_hit", "requests",
                "errors", "wall_s", "cpu_ms_per_request")


@dataclass(frozen=True)
class LiveSpec:
    trace: str
    sessions: int = 12
    turns: int = 6
    concurrency: int = 12
    engines: int = 4
    profile: str = "gb300-glm52-pressure"
    pace: str = "agent:60:10"
    speedup: float = 10.0  # client pauses divided by this (engine time is not: time_scale)
    time_scale: float = 1.0  # engines' model seconds per wall second, both sides
    block_tokens: int = 64
    overhead_requests: int = 100
    idle_s: float = 10.0  # CPU of the idle stack measured this long before the trace (0: not)
    stacks: tuple[str, ...] = ("dynamo", "evolving")
    timeout_s: float = 600.0


# --------------------------------------------------------------------------- inputs both sides read
def equalised_profile_toml(name_or_path: str, dst: Path) -> Path:
    """``--profile`` as a TOML file of :func:`equalised_profile` (``c2 = c3 = 0``, noise off, one
    token a decode iteration at eq. 2 / ``t_acc``, no fixed P -> D latency), for ``evolving up
    --profile FILE``; checked against the in-memory equalised profile."""
    src = Path(name_or_path) if Path(name_or_path).suffix else PROFILE_DIR / f"{name_or_path}.toml"
    text = src.read_text()
    want = equalised_profile(load_profile(str(src)))
    subs = [(r"(?m)^name\s*=.*$", f'name = "{want.name}"'), (r"(?m)^c2\s*=.*$", "c2 = 0.0"),
            (r"(?m)^c3\s*=.*$", "c3 = 0.0"), (r"(?m)^noise\s*=.*$", "noise = 0.0")]
    subs += [(rf"(?m)^{k}\s*=.*$", f"{k} = {getattr(want, k)!r}")
             for k in ("d0", "d1", "d2", "d_ctx", "t_acc", "p2d_latency_s")]
    for pat, rep in subs:
        text = re.sub(pat, rep, text)
    dst.write_text(text)
    got = load_profile(str(dst))
    if got != want:
        raise ValueError(f"{src}: the rewritten profile is not the equalised one ({dst})")
    return dst


def write_tokenizer(dst: Path) -> Path:
    """The bundled SmolLM2 tokenizer as a Hugging Face folder (tokenizer.json, its config with the
    chat template Dynamo's frontend requires, a config.json): the mocker's ``--model-path``."""
    from engine.model_files import smollm2_gguf  # lazy: reads the GGUF only for the live bench
    from services.drivers.gateway.gguf_meta import read_metadata  # lazy: as above
    from services.drivers.gateway.model import gguf_tokenizer  # lazy: as above

    dst.mkdir(parents=True, exist_ok=True)
    gguf = str(smollm2_gguf())
    meta = read_metadata(gguf)
    gguf_tokenizer(meta, gguf).save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": meta["tokenizer.chat_template"]}))
    (dst / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "max_position_embeddings": 1 << 20, "bos_token_id": 1, "eos_token_id": 2}))
    return dst


# --------------------------------------------------------------------------- CPU by process
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def process_tree(roots: list[int]) -> list[int]:
    """``roots`` and every descendant alive now."""
    kids, out, todo = _children(), [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return sorted(set(out))


def cpu_s(pid: int) -> float | None:
    """utime + stime of a live process (all its threads), seconds; ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def role_of(pid: int) -> str:
    """What a process is, from its command line: a service of ours, an engine, nats-server, or
    Dynamo's frontend / mocker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "gone"
    cmd = " ".join(argv)
    if argv and argv[0].endswith("nats-server"):
        return "nats-server"
    for key, role in (("dynamo.frontend", "frontend"), ("dynamo.mocker", "mockers"), ("engine.worker", "engines"),
                      ("services.drivers.gateway", "gateway")):
        if key in cmd:
            return role
    if "services.drivers.serve" in cmd:
        i = argv.index("services.drivers.serve") if "services.drivers.serve" in argv else -1
        return argv[i + 1] if 0 <= i < len(argv) - 1 else "service"
    if " up " in f" {cmd} ":
        return "up"
    return "other"


class CpuMeter:
    """CPU seconds by role of a fixed set of processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, roots: list[int]) -> None:
        self.pids = process_tree(roots)
        self.roles = {p: role_of(p) for p in self.pids}
        self.t0: dict[int, float] = {}

    def start(self) -> None:
        self.t0 = {p: c for p in self.pids if (c := cpu_s(p)) is not None}

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p, c0 in self.t0.items():
            c1 = cpu_s(p)
            if c1 is not None:
                out[self.roles[p]] = out.get(self.roles[p], 0.0) + c1 - c0
        return out


# --------------------------------------------------------------------------- the two stacks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
    """Stop a child started in its own session, its group with it (SIGKILL after ``timeout_s``)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


class DynamoStack:
    """``dynamo.mocker`` (``engines`` aggregated workers, one process) and ``dynamo.frontend``
    (KV router) in ``.venv-dynamo``, file discovery (no etcd, no NATS), logs in ``work``."""

    stack = "dynamo"

    def __init__(self, spec: LiveSpec, prof: Profile, work: Path, python: Path = DYNAMO_PYTHON) -> None:
        self.spec, self.prof, self.work, self.python = spec, prof, work / "dynamo", python
        self.procs: list[subprocess.Popen] = []
        self.url = ""

    def start(self) -> list[int]:
        w = self.work
        (w / "kv").mkdir(parents=True, exist_ok=True)
        tok = write_tokenizer(self.work.parent / "tokenizer")
        npz = write_mocker_npz(self.prof, w / "mocker_perf.npz")
        args = mocker_engine_args(self.prof, "aggregated", npz)
        # the gateway's context limit on both sides: a longer request is refused by both (ours a 400,
        # Dynamo's frontend a 500), not served by one only
        args["engine"]["max_model_len"] = GatewayConfig().context_length
        args["dynamo"] = {"enable_local_indexer": True}  # what the mocker's own flags set: KV events for the router
        (w / "engine.json").write_text(json.dumps(args))
        port = _free_port()
        env = {**os.environ, "DYN_FILE_KV": str(w / "kv"), "RUST_LOG": "error", "DYN_LOG": "error"}
        py = str(self.python)
        mocker = [py, "-m", "dynamo.mocker", "--model-path", str(tok), "--model-name", MODEL,
                  "--num-workers", str(self.spec.engines), "--extra-engine-args", str(w / "engine.json"),
                  "--speedup-ratio", str(self.spec.time_scale), "--discovery-backend", "file"]
        front = [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                 "--router-mode", "kv", "--kv-cache-block-size", str(self.prof.block_tokens), "--discovery-backend", "file"]
        for name, cmd in (("mocker", mocker), ("frontend", front)):
            with open(w / f"{name}.log", "wb") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=w, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"Dynamo exited while starting: see {w}/mocker.log, {w}/frontend.log")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if any(m.get("id") == MODEL for m in json.load(r).get("data", [])):
                        return [p.pid for p in self.procs]
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Dynamo's frontend served no model within 120 s ({w}/frontend.log)")

    def stop(self) -> None:
        for p in reversed(self.procs):
            _stop(p)


class EvolvingStack:
    """``evolving up --engines N --profile FILE`` (its embedded NATS, services, gateway)."""

    stack = "evolving"

    def __init__(self, spec: LiveSpec, prof_toml: Path, work: Path, tree: Path | None = None) -> None:
        self.spec, self.prof_toml = spec, prof_toml
        self.tree = tree or ROOT  # another checkout (a worktree of an older commit): its code serves
        self.stack = "evolving" if tree is None else f"evolving:{tree}"
        self.work = work / ("evolving" if tree is None else f"evolving-{tree.name}")
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> list[int]:
        self.work.mkdir(parents=True, exist_ok=True)
        ready = self.work / "ready.json"
        cmd = [sys.executable, "-m", "services.drivers.cli", "up", "--engines", str(self.spec.engines),
               "--profile", str(self.prof_toml), "--time-scale", str(self.spec.time_scale),
               "--run-dir", str(self.work / "run"), "--gateway-port", "0", "--ready-file", str(ready),
               "--no-status", "--metrics-port", "-1"]
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        with open(self.work / "up.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if ready.exists():
                self.url = json.loads(ready.read_text())["gateway"]
                return [self.proc.pid]
            if self.proc.poll() is not None:
                raise RuntimeError(f"evolving up exited with {self.proc.returncode}: see {self.work}/up.log")
            time.sleep(0.3)
        raise TimeoutError(f"evolving up not ready within 180 s ({self.work}/up.log)")

    def stop(self) -> None:
        if self.proc is not None:  # SIGINT: up's own orderly stop of its children, then the group
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            _stop(self.proc, signal.SIGKILL)


# --------------------------------------------------------------------------- the client
def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def drive_trace(url: str, sessions, spec: LiveSpec, run_id: str) -> DriveReport:
    cfg = DriveConfig(gateway=url, concurrency=spec.concurrency, speedup=spec.speedup, model=MODEL,
                      timeout_s=spec.timeout_s, run_id=run_id, token_ids=VOCAB)
    return await Driver(cfg).run(sessions)


async def overhead_ttfts(url: str, n: int, clients: int, run_id: str, block_tokens: int) -> list[float]:
    """TTFT of ``n`` streaming ``max_tokens`` 1 requests, ``clients`` at a time, each with a fresh
    ``block_tokens``-token prompt."""
    cfg = DriveConfig(gateway=url, model=MODEL, run_id=run_id)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        d = Driver(cfg, http)
        left = list(range(n))

        async def client() -> None:
            while left:
                k = left.pop()
                ids = synth_ids([], block_tokens, block_tokens, f"{run_id}{k}", VOCAB)
                await d.post("overhead", f"{run_id}{k}", f"{run_id}{k}", ids, 1, {"x-branch-id": f"{run_id}{k}"})

        await asyncio.gather(*(client() for _ in range(clients)))
    bad = [r for r in d.report.results if r.status != 200 or r.ttft_s is None]
    if bad:
        raise RuntimeError(f"{len(bad)} of {n} overhead requests failed: {bad[0].error or bad[0].status}")
    return [r.ttft_s for r in d.report.results]


def trace_figures(rep: DriveReport, cpu: dict[str, float]) -> dict[str, float]:
    ok = rep.ok
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.latency_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    n = len(ok)
    out = {"throughput_rps": n / rep.wall_s if rep.wall_s > 0 else float("nan"),
           "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95), "e2e_mean_s": float(np.mean(e2e)) if e2e else float("nan"),
           "e2e_p95_s": _pct(e2e, 95), "kv_hit": sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan"),
           "requests": float(n), "errors": float(len(rep.failed)), "wall_s": rep.wall_s,
           "cpu_ms_per_request": 1000.0 * sum(cpu.values()) / n if n else float("nan")}
    for role, s in sorted(cpu.items()):
        out[f"cpu_ms_per_request.{role}"] = 1000.0 * s / n if n else float("nan")
    return out


def run_stack(stack, spec: LiveSpec, sessions, prefill_1block_s: float) -> tuple[dict[str, float], list[str]]:
    """The trace through ``stack`` (started here, stopped on the way out), then the overhead probe;
    its figures and the distinct errors of the failed trace requests."""
    roots = stack.start()
    try:
        meter = CpuMeter(roots)
        idle: dict[str, float] = {}
        if spec.idle_s > 0:  # what the stack burns with nothing to serve: CPU ms per wall second
            meter.start()
            time.sleep(spec.idle_s)
            idle = {k: 1000.0 * v / spec.idle_s for k, v in meter.stop().items()}
        meter.start()
        rep = asyncio.run(drive_trace(stack.url, sessions, spec, f"live-{stack.stack}-{os.getpid()}-"))
        figs = trace_figures(rep, meter.stop())
        errors = sorted({r.error[:160] for r in rep.failed})
        if idle:
            figs["idle_cpu_ms_per_s"] = sum(idle.values())
            figs.update({f"idle_cpu_ms_per_s.{k}": v for k, v in sorted(idle.items())})
        for clients in (1, 8):
            if spec.overhead_requests <= 0:
                break
            t = asyncio.run(overhead_ttfts(stack.url, spec.overhead_requests, clients,
                                           f"oh{clients}-{stack.stack}-{os.getpid()}-", spec.block_tokens))
            for q in (50, 99):
                figs[f"overhead_ttft_p{q}_ms.c{clients}"] = 1000.0 * _pct(t, q)
                figs[f"overhead_path_p{q}_ms.c{clients}"] = 1000.0 * (_pct(t, q) - prefill_1block_s)
        return figs, errors
    finally:
        stack.stop()


def run_live(spec: LiveSpec, work: Path, python: Path = DYNAMO_PYTHON) -> dict:
    """Every row of the live table, and what it ran (the module docstring)."""
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.mooncake.jsonl"
    n = write_trace(OfflineSpec(trace=spec.trace, sessions=spec.sessions, turns=spec.turns,
                                block_tokens=spec.block_tokens, concurrency=spec.concurrency, profile=spec.profile,
                                prefill=0, decode=spec.engines, stacks=(), pace=spec.pace), trace)
    sessions = load_workload(f"mooncake:{trace}", block_tokens=spec.block_tokens).sessions
    prof = equalised_profile(load_profile(spec.profile))
    prof_toml = equalised_profile_toml(spec.profile, work / "profile.toml")
    prefill_1block_s = prof.prefill_iteration_s(spec.block_tokens, 0, 0)
    rows: list[dict] = []
    notes: list[str] = []
    version = None
    for name in spec.stacks:
        if name == "dynamo":
            why = dynamo_missing(python)
            if why:
                notes.append(f"no dynamo row: {why}")
                continue
            version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('ai-dynamo'))"],
                                     capture_output=True, text=True, check=False).stdout.strip()
            stack = DynamoStack(spec, prof, work, python)
        elif name == "evolving":
            stack = EvolvingStack(spec, prof_toml, work)
        elif name.startswith("evolving:"):
            stack = EvolvingStack(spec, prof_toml, work, Path(name.split(":", 1)[1]).resolve())
        else:
            raise ValueError(f"live stacks: dynamo, evolving or evolving:CHECKOUT; got {name!r}")
        figs, errors = run_stack(stack, spec, sessions, prefill_1block_s)
        if figs["requests"] != n:
            notes.append(f"{stack.stack}: {figs['requests']:.0f} of the trace's {n} requests answered, "
                         f"{figs['errors']:.0f} failed: " + "; ".join(errors[:3]))
        rows += [{"mode": "live", "stack": stack.stack, "metric": k, "value": v} for k, v in figs.items()]
    return {"rows": rows, "requests": n, "notes": notes, "dynamo_version": version, "profile": prof.name,
            "prefill_1block_ms": 1000.0 * prefill_1block_s, "spec": {**spec.__dict__, "stacks": list(spec.stacks)},
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def print_live(result: dict) -> None:
    rows = result["rows"]
    stacks = list(dict.fromkeys(r["stack"] for r in rows))
    by = {(r["stack"], r["metric"]): r["value"] for r in rows}
    seen = list(dict.fromkeys(r["metric"] for r in rows))
    metrics = [m for m in LIVE_METRICS if m in seen] + sorted(m for m in seen if m not in LIVE_METRICS)
    s = result["spec"]
    print(f"live: {result['requests']} requests ({s['sessions']} sessions x <= {s['turns']} turns, pace {s['pace']}, "
          f"pauses / {s['speedup']:g}), {s['concurrency']} sessions at a time, {s['engines']} engines of "
          f"{result['profile']} at time scale {s['time_scale']:g}; ai-dynamo {result['dynamo_version'] or '-'}; "
          f"load {' '.join(result['loadavg'])}")
    fmt = {"throughput_rps": "{:.3f}", "kv_hit": "{:.1%}", "requests": "{:.0f}", "errors": "{:.0f}", "wall_s": "{:.1f}"}
    for i, x in enumerate(stacks):
        if len(x) > 13:
            print(f"note: column {i + 1} is {x}")
    print(f"{'metric':<34}" + "".join(f"{x[:13]:>14}" for x in stacks))
    for k in metrics:
        cells = ["-" if (x, k) not in by else fmt.get(k, "{:.3f}").format(by[(x, k)]) for x in stacks]
        print(f"{k:<34}" + "".join(f"{c:>14}" for c in cells))
    print(f"note: overhead_path = TTFT - the model's prefill of the 64-token prompt ({result['prefill_1block_ms']:.1f} ms)")
    for note in result["notes"]:
        print(f"note: {note}")


__all__ = ["CpuMeter", "DynamoStack", "EvolvingStack", "LiveSpec", "equalised_profile_toml", "process_tree",
           "role_of", "run_live", "trace_figures", "write_tokenizer"]
