"""``evolving bench dynamo --offline``: the real NVIDIA Dynamo (ai-dynamo 1.6.1) side by side with
our simulator's stacks on the same trace, the same request count and the same engine model
(docs/experiments.md, "Against the real Dynamo").

1. The trace: the first ``--sessions`` sessions of ``--trace`` (the bundled real Claude Code
   sessions), each cut to its first ``--turns`` requests, exported as Mooncake JSONL with
   ``--block-tokens`` blocks (``evolving trace export mooncake``'s code) after ``--pace`` (the
   README demo's ``agent:60:10`` by default); both sides read that one file, pauses included.
2. The engine: :func:`~services.drivers.bench.dynamo_model.equalised_profile` of ``--profile``
   on our side (one token a decode iteration, one more output token a request: the mocker's
   decode steps), the same model as the mocker's profiling data (NPZ) and limits on Dynamo's.
3. Dynamo: ``dynamo.replay.run_trace_replay`` (its KV router, ``--prefill`` prefill and
   ``--decode`` decode mocker workers, ``replay_concurrency`` = ``--concurrency``), run by
   services/drivers/bench/dynamo_child.py in ``.venv-dynamo`` (``bash scripts/setup.sh --dynamo``).
4. Ours: each ``--stacks`` stack on ``prefill + decode`` simulated nodes, ``--concurrency``
   sessions at a time, no refill (``SimConfig.refill``): the trace ends the run. Dynamo-style
   is deployed as the replay deploys the real one (:func:`replica_of_replay`: its KV router, the
   real one's split held, no planner; ``dynamo-planned``: the matrix's baseline at that split); evolving starts there too (``--start split``) and its planner
   moves when sure after its ``--warmup``, or warms up collocated (``--start collocated``); our
   other stacks' nodes keep the profile's host tier unless ``--host-kv-tokens`` says otherwise,
   dynamo-style's have none (the replay's mocker workers have none). With ``--keep`` each stack's event log is kept (``<stack>.duckdb``) for
   ``evolving sim-report`` / ``sql`` / ``verify``.

Per stack: throughput (requests / the span from the first arrival to the last finish), TTFT
P50 / P95, E2E mean / P95 (every request, percentiles by ``numpy.percentile``), KV hit (prompt
tokens served from cache / prompt tokens), wall and CPU time per simulated request. ``--json``
prints ``{"rows": [{"mode", "stack", "metric", "value"}]}`` (stack ``dynamo``: the real one).
``--live`` serves the same kind of trace through both live stacks instead
(services/drivers/bench/dynamo_live.py); ``--offline --live`` runs both parts, rows of both modes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.profiles import Profile, load_profile
from replay.sim.figures import MetricsFold
from replay.sim.inputs import load_trace
from replay.sim.simlog import SimLog
from replay.sim.simulation import SimConfig, Simulation
from replay.sim.stacks import get_stack
from replay.traces.export import export_sessions
from replay.traces.importers.spec import load_workload
from replay.traces.pacing import pace_sessions
from services.drivers.bench.dynamo_model import (
    equalised_profile,
    mocker_decode_outputs,
    mocker_engine_args,
    write_mocker_npz,
)

ROOT = Path(__file__).resolve().parents[3]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
CHILD = Path(__file__).with_name("dynamo_child.py")
METRICS = ("throughput_rps", "ttft_p50_s", "ttft_p95_s", "prefill_done_p50_s", "prefill_done_p95_s", "e2e_mean_s", "e2e_p95_s", "kv_hit", "requests",
           "wall_ms_per_request", "cpu_ms_per_request")


@dataclass(frozen=True)
class OfflineSpec:
    trace: str
    sessions: int
    turns: int
    block_tokens: int
    concurrency: int
    profile: str
    prefill: int
    decode: int
    stacks: tuple[str, ...]
    pace: str = "agent:60:10"
    seed: int = 0
    # our stacks' warm-up (SimConfig.warmup_s): evolving serves collocated and fits its models
    # for this long, then takes its first split (METHOD.md §4.2-4.3; two of the planner's 60 s
    # slices, the fewest its 2-SE test reads); baselines serve their split from t = 0 either way.
    # Every request counts in the figures, the warm-up's included
    warmup_s: float = 120.0
    # our nodes' host (L2) KV tokens; None: the profile's. The mocker has no host tier: 0 is
    # Dynamo's KV side exactly (docs/experiments.md, "Offline in the pressure regime"); the
    # dynamo-style row has none whatever this says (replica_of_replay)
    host_kv_tokens: int | None = None
    # how a stack of ours that picks its own split (evolving) starts: "split" serves the
    # --prefill / --decode split from t = 0, the deployment the real Dynamo's workers are given,
    # and its planner moves from there only when sure; "collocated" warms up collocated and picks
    # its first split at the warm-up end (METHOD.md §4.2)
    start: str = "split"
    # the order of the sessions in the Mooncake file both sides read (None: the trace's): every
    # session's first turn arrives at t = 0, so this is the order the cold wave is routed in, and
    # the placements of the whole run follow from it (docs/experiments.md, "Against the real
    # Dynamo": the P95's spread over these orders)
    order_seed: int | None = None


def dynamo_missing(python: Path = DYNAMO_PYTHON) -> str | None:
    """Why the real Dynamo cannot run here, or ``None``."""
    if not python.exists():
        return f"{python} is missing: bash scripts/setup.sh --dynamo"
    r = subprocess.run([str(python), "-c", "import dynamo.replay"], capture_output=True, text=True, timeout=120, check=False)
    if r.returncode:
        return f"dynamo.replay does not import in {python}: {r.stderr.strip().splitlines()[-1:]}"
    return None


def write_trace(spec: OfflineSpec, path: Path) -> int:
    """The Mooncake file both sides replay; returns its request count."""
    sessions = pace_sessions(sorted(load_trace(spec.trace), key=lambda s: s.id)[: spec.sessions], spec.pace)
    export_sessions(path, sessions, "mooncake", spec.block_tokens)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept: list[dict] = []
    seen: dict[str, int] = {}
    for r in rows:
        k = seen[r["session_id"]] = seen.get(r["session_id"], 0) + 1
        if k <= spec.turns:
            kept.append(r)
    seed = getattr(spec, "order_seed", None)
    if seed is not None:  # whole sessions move, each one's turns in their order
        by: dict[str, list[dict]] = {}
        for r in kept:
            by.setdefault(r["session_id"], []).append(r)
        order = list(by)
        random.Random(seed).shuffle(order)
        kept = [r for sid in order for r in by[sid]]
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
    return len(kept)


def figures(ttft_s: list[float], e2e_s: list[float], span_s: float, hit: float, wall_s: float,
            cpu_s: float, prefill_done_s: list[float] | None = None, requests: int | None = None) -> dict[str, float]:
    """``prefill_done_s``: arrival to the end of the prefill, where it differs from the TTFT (Dynamo's
    disaggregated TTFT is the decode worker's first token, after the KV transfer; our simulator's is
    the prefill's own first token: docs/experiments.md, "Against the real Dynamo")."""
    n = len(ttft_s) if requests is None else requests
    done = ttft_s if prefill_done_s is None else prefill_done_s
    return {"throughput_rps": n / span_s if span_s > 0 else float("nan"),
            "ttft_p50_s": float(np.percentile(ttft_s, 50)), "ttft_p95_s": float(np.percentile(ttft_s, 95)),
            "prefill_done_p50_s": float(np.percentile(done, 50)), "prefill_done_p95_s": float(np.percentile(done, 95)),
            "e2e_mean_s": float(np.mean(e2e_s)), "e2e_p95_s": float(np.percentile(e2e_s, 95)), "kv_hit": hit,
            "requests": float(n), "wall_ms_per_request": 1000.0 * wall_s / n, "cpu_ms_per_request": 1000.0 * cpu_s / n}


def run_dynamo(spec: OfflineSpec, trace: Path, prof: Profile, work: Path,
               python: Path = DYNAMO_PYTHON) -> tuple[dict[str, float], dict]:
    npz = write_mocker_npz(prof, work / "mocker_perf.npz")
    child_spec = {"trace": str(trace), "block_size": spec.block_tokens, "concurrency": spec.concurrency,
                  "router_mode": "kv_router", "prefill_workers": spec.prefill, "decode_workers": spec.decode,
                  "prefill_engine_args": mocker_engine_args(prof, "prefill", npz),
                  "decode_engine_args": mocker_engine_args(prof, "decode", npz)}
    (work / "spec.json").write_text(json.dumps(child_spec))
    env = {**os.environ, "RUST_LOG": "error", "DYN_LOG": "error"}
    r = subprocess.run([str(python), "-P", str(CHILD), str(work / "spec.json"), str(work / "out.json")],
                       capture_output=True, text=True, env=env, timeout=1800, check=False)
    if r.returncode:
        raise RuntimeError(f"the Dynamo replay failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
    out = json.loads((work / "out.json").read_text())
    reqs = [q for q in out["requests"] if q.get("terminal_status") == "completed"]
    # a request with no output token (output_length 0 in the trace) has no TTFT / E2E in Dynamo's report
    timed = [q for q in reqs if q["ttft_ms"] is not None and q["e2e_latency_ms"] is not None]
    ttft = [q["ttft_ms"] / 1000.0 for q in timed]
    e2e = [q["e2e_latency_ms"] / 1000.0 for q in timed]
    t0 = min(q["arrival_time_ms"] for q in reqs)
    span = max(q["arrival_time_ms"] + q["e2e_latency_ms"] for q in timed) - t0
    hit = sum(q["reused_input_tokens"] for q in reqs) / sum(q["input_length"] for q in reqs)
    done = [(q["source_held_ms"] - q["arrival_time_ms"]) / 1000.0 for q in timed if q.get("source_held_ms") is not None]
    if len(timed) < len(reqs):
        out["untimed"] = len(reqs) - len(timed)
    return figures(ttft, e2e, span / 1000.0, hit, out["wall_s"], out["cpu_s"],
                   done if len(done) == len(timed) else None, requests=len(reqs)), out


#: ``--stacks`` name of the simulator's Dynamo baseline as the experiment matrix runs it (its
#: planner and SGLang-style cache-aware routing, METHOD.md's baseline), at the real one's split
PLANNED = "dynamo-planned"


def replica_of_replay(stack):
    """Our Dynamo-style stack as Dynamo's offline replay deploys the real one: its KV router on
    the prefill and decode workers (``dynamo_kv``: services/cores/router/dynamo.py) and the
    split held (``run_trace_replay`` runs no planner without a ``planner_config``; the bench
    gives none). The matrix's Dynamo baseline keeps its planner and cache-aware routing
    (``--stacks dynamo-planned``): with them at ``scale:0`` its planner restarted a prefill
    node into decode at 125 s and its P95 prefill-done doubled (docs/experiments.md, "Offline
    in the pressure regime"). Its nodes have no host KV tier either (:func:`run_ours`): the
    replay's mocker workers have GPU KV only, and with the profile's 7.4M host tokens a node,
    restored at no cost on the equalised engine, the replica recomputed less than the real one
    after an eviction (docs/experiments.md, "Against the real Dynamo")."""
    return replace(stack, planner="static", router="dynamo_kv")


def run_ours(spec: OfflineSpec, trace: Path, prof: Profile, stack_name: str,
             log_path: Path | None = None) -> tuple[dict[str, float], object]:
    """One of our stacks on the trace. ``log_path``: also write its full event log there (DuckDB,
    the simulator's own writer: ``evolving sim-report`` / ``sql`` / ``verify`` read it); the
    wall and CPU time then include the writer's share in this process."""
    # one more output token a request: our node emits the first at the prefill's end, the mocker's decode
    # worker emits all of them after the transfer (dynamo_model.mocker_decode_outputs)
    sessions = mocker_decode_outputs(load_workload(f"mooncake:{trace}", block_tokens=spec.block_tokens).sessions)
    horizon_s = 30 * 24 * 3600.0  # a bound only: the trace ends the run (refill off)
    cfg = SimConfig(nodes=spec.prefill + spec.decode, warmup_s=spec.warmup_s, duration_s=horizon_s, seed=spec.seed,
                    agents=spec.concurrency, stagger_s=0.0, refill=False)
    if spec.start not in ("split", "collocated"):
        raise ValueError(f"start: split or collocated, got {spec.start!r}")
    stack = replace(get_stack("dynamo"), name=PLANNED) if stack_name == PLANNED else get_stack(stack_name)
    if stack.split is None and spec.start == "split":
        stack = replace(stack, start=(spec.prefill, spec.decode))
    if stack.name in ("dynamo", PLANNED):  # the real one's split (--prefill / --decode), not two thirds of the nodes
        stack = replace(stack, split=(spec.prefill, spec.decode))
    if stack.name == "dynamo":
        stack = replica_of_replay(stack)
        prof = replace(prof, l2_capacity_tokens=0)  # the replay's mocker workers: GPU KV only
    fold = MetricsFold(0.0, cfg.end_s)
    rec = None
    if log_path is not None:  # the run_config replay/sim/runs.py writes, so verify rebuilds the same cores
        rec = SimLog(log_path, config={"driver": "simulator", "stack": stack.describe(), "profile": prof.name,
                                       "kv_gpu_tokens": prof.l1_capacity_tokens, "kv_host_tokens": prof.l2_capacity_tokens,
                                       "nodes": cfg.nodes, "seed": cfg.seed, "warmup_s": cfg.warmup_s,
                                       "duration_s": cfg.duration_s, "agents": cfg.agents,
                                       "arrivals_per_min": cfg.arrivals_per_min, "bench": "dynamo --offline",
                                       **stack.core_config(prof, cfg)})
    sim = Simulation(prof, stack, sessions, cfg, record=rec, keep_log=False, observe=fold)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        res = sim.run()
    finally:
        if rec is not None:
            rec.close()
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    m = fold.metrics(stack.name)
    span = sim.now  # the clock stops at the last finish; every session starts at 0
    return figures(list(m.ttft_s), list(m.e2e_s), span, m.kv_hit_actual, wall_s, cpu_s), (m, res)


def run_offline(spec: OfflineSpec, python: Path = DYNAMO_PYTHON, work: Path | None = None,
                keep_logs: bool = False) -> dict:
    """Every row of the offline table, and what it ran. ``keep_logs``: each of our stacks also
    writes its event log to ``work/<stack>.duckdb`` (``--keep``), listed in ``logs``."""
    tmp = None
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-dynamo-")
        work = Path(tmp.name)
    try:
        trace = work / "trace.mooncake.jsonl"
        n = write_trace(spec, trace)
        prof = equalised_profile(load_profile(spec.profile))
        if spec.host_kv_tokens is not None:
            prof = replace(prof, l2_capacity_tokens=spec.host_kv_tokens)
        rows: list[dict] = []
        notes: list[str] = []
        results: dict[str, dict[str, float]] = {}
        logs: dict[str, str] = {}
        why = dynamo_missing(python)
        version = None
        if why is None:
            results["dynamo"], out = run_dynamo(spec, trace, prof, work, python)
            version = out["version"]
            if len(out["requests"]) != n:
                notes.append(f"Dynamo replayed {len(out['requests'])} of the trace's {n} requests")
            if out.get("untimed"):
                notes.append(f"dynamo: {out['untimed']} request(s) with no output token have no TTFT / E2E (left out of "
                             "its latency figures)")
        else:
            notes.append(f"no dynamo row: {why}")
        for st in spec.stacks:
            label = row_label(st)
            log = work / f"{label.replace(':', '_')}.duckdb" if keep_logs else None
            results[label], (m, res) = run_ours(spec, trace, prof, st, log)
            if log is not None:
                logs[label] = str(log)
            if res.finished != n:
                notes.append(f"{label}: {res.finished} of the trace's {n} requests finished")
            split = {k: v for k, v in m.split_time_s.items() if v > 0}
            total = sum(split.values()) or 1.0  # the fold counts to the horizon: shares, not seconds
            notes.append(f"{label}: time in split " + ", ".join(
                f"{k} {v / total:.0%}" for k, v in sorted(split.items(), key=lambda kv: -kv[1])[:3]))
        for stack, figs in results.items():
            rows += [{"mode": "offline", "stack": stack, "metric": k, "value": figs[k]} for k in METRICS]
        return {"rows": rows, "requests": n, "notes": notes, "dynamo_version": version, "profile": prof.name,
                "spec": spec.__dict__, "logs": logs}
    finally:
        if tmp is not None:
            tmp.cleanup()


def row_label(stack: str) -> str:
    """Our stack's name in the rows: ``dynamo`` is the real one, ours is ``dynamo-style``."""
    return "dynamo-style" if stack == "dynamo" else stack


def ratios(rows: list[dict], base: str = "dynamo", against: str = "dynamo") -> dict[str, float]:
    """``against``'s figure over the real Dynamo's, per metric (1.0 = equal)."""
    by = {(r["stack"], r["metric"]): r["value"] for r in rows}
    return {k: by[(against, k)] / by[(base, k)] for k in METRICS
            if (base, k) in by and (against, k) in by and by[(base, k)]}


def print_table(result: dict) -> None:
    rows = result["rows"]
    stacks = list(dict.fromkeys(r["stack"] for r in rows))
    by = {(r["stack"], r["metric"]): r["value"] for r in rows}
    spec = result["spec"]
    print(f"offline: {result['requests']} requests ({spec['sessions']} sessions x <= {spec['turns']} turns of "
          f"{spec['trace']}, pace {spec['pace']}), {spec['concurrency']} at a time, {spec['prefill']}P{spec['decode']}D, engine "
          f"{result['profile']}; ai-dynamo {result['dynamo_version'] or '-'}; ours: start {spec.get('start', 'collocated')}, warm-up {spec.get('warmup_s', 0):g} s, "
          f"host KV {'the profile' + chr(39) + 's' if spec.get('host_kv_tokens') is None else spec['host_kv_tokens']}")
    fmt = {"throughput_rps": "{:.3f}", "kv_hit": "{:.1%}", "requests": "{:.0f}"}
    print(f"{'metric':<22}" + "".join(f"{s:>16}" for s in stacks))
    for k in METRICS:
        cells = []
        for s in stacks:
            v = by.get((s, k))
            cells.append("-" if v is None else fmt.get(k, "{:.3f}").format(v))
        print(f"{k:<22}" + "".join(f"{c:>16}" for c in cells))
    if "dynamo" in stacks and len(stacks) > 1:
        for s in stacks[1:]:
            rs = ratios(rows, against=s)
            print(f"{s} / dynamo: " + ", ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
    for note in result["notes"]:
        print(f"note: {note}")
    for stack, path in result.get("logs", {}).items():
        print(f"log: {stack} {path}")


__all__ = ["PLANNED", "OfflineSpec", "dynamo_missing", "figures", "ratios", "replica_of_replay", "run_dynamo",
           "run_offline", "run_ours", "write_trace"]
