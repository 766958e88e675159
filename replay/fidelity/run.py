"""``evolving fidelity``: the same scaled real sessions served live and simulated, per stack.

1. **Sessions.** The trace's sessions shrunk until CPU torch engines serve them in minutes
   (replay/fidelity/workload.py; the scaling is printed). The *test* sessions are the first
   ``--sessions`` that fit after the ``--calibration-sessions`` used for calibration: the
   comparison is on sessions the profile never saw.
2. **Profile.** ``--profile FILE`` (or a name), or ``--calibration-log LOG`` fitted by
   ``evolving calibrate``'s code, or (default) a live ``evolving`` run on the calibration sessions,
   fitted and written to ``OUT_DIR/calibrated.toml``.
3. **Per stack**: a live run (replay/fidelity/live.py: ``evolving up --engines torch:N``, the
   sessions through its gateway) and a simulated run of the same sessions on the profile with
   the same configuration (replay/fidelity/compare.py); both logs are kept in ``--out-dir``.
4. **Table**: per stack and metric, live and simulated, and how far apart (the issue's bar is
   +-25% on throughput and P50 / P95 TTFT), then whether the stacks rank the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine.profiles import load_profile
from replay.fidelity.calibrate import calibrate_log, format_calibration, profile_toml
from replay.fidelity.compare import (
    GATED,
    TIE_TOLERANCE,
    TOLERANCE,
    metrics_of,
    off_by,
    planner_offset_s,
    ranked,
    ranking,
    rows,
    run_sim,
    same_ranking,
    sim_warmup_s,
)
from replay.fidelity.live import LiveRun, run_live
from replay.fidelity.requests import format_split, request_times, split_ratios
from replay.fidelity.workload import Scaling, prefill_sweep, scaled_sessions, workload_figures
from replay.sim.simlog import SimLog
from replay.sim.simulation import SimConfig
from replay.sim.stacks import get_stack
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.gateway.drive import DriveReport
from services.drivers.up.launch import torch_engine_env

#: the torch run's planner keywords (services/drivers/up/models.py TORCH_PLANNER_DEFAULTS), given
#: to both sides explicitly so the simulated planner is configured as the live one
PLANNER_ARGS = {"window_s": 10, "slices": 2, "cooldown_s": 60}
#: the order a torch engine serves its prefill queue in (engine/backends/torch: arrival, the
#: running chunk first). A stack's simulated ``prefill_order`` (the evolving stack's
#: ``short_first``, engine/backends/sim/prefill_order.py) is an engine scheduling policy the torch
#: engine does not have, so both sides of a fidelity run take the engine's: the simulator models
#: the engines that served live, and the live router prices their queues as they are served
LIVE_PREFILL_ORDER = "fcfs"


#: SmolLM2-135M's vocabulary (the torch engines' default model, a GGUF file)
SMOLLM2_VOCAB = 49152


def vocab_of(model: str | None) -> int:
    """The vocabulary size of ``--model``: a Hugging Face folder's ``config.json``; SmolLM2's for the
    default model or a GGUF file (prompt ids are drawn below it)."""
    cfg = Path(model or "") / "config.json"
    if model and cfg.is_file():
        return int(json.loads(cfg.read_text())["vocab_size"])
    return SMOLLM2_VOCAB


@dataclass(frozen=True, kw_only=True)
class FidelitySpec:
    """``evolving fidelity``'s options, named as its flags (replay/fidelity/cli.py)."""

    trace: str
    stacks: str = "evolving,dynamo,static:1P1D"
    engines: int = 2  # torch engines (= simulated nodes) per stack
    sessions: int = 4
    calibration_sessions: int = 4
    calibration_sweep: str = "512,1024,2048,4096"  # cold prompts (tokens) served before the calibration sessions
    concurrency: int = 4
    turns: int = 3
    token_scale: int = 64
    output_scale: int = 16
    max_output: int = 16
    pause_scale: float = 0.05
    warmup_s: float = 30.0
    profile: str | None = None  # skip calibration: this profile
    calibration_log: str | None = None
    model: str | None = None
    seed: int = 0
    reuse_live: bool = False
    out_dir: str | None = None
    json: bool = False


@dataclass(frozen=True, kw_only=True)
class CalibrateSpec:
    """``evolving calibrate``'s options, named as its flags (replay/fidelity/cli.py)."""

    log: str
    out: str
    name: str | None = None
    base: str = "gb300-glm52"
    json: bool = False


def scaling_of(spec: FidelitySpec) -> Scaling:
    return Scaling(sessions=spec.sessions, concurrency=spec.concurrency, turns=spec.turns, tokens=spec.token_scale,
                   output=spec.output_scale, max_output=spec.max_output, pause=spec.pause_scale,
                   skip=spec.calibration_sessions)


def read_events(db: Path) -> list:
    with DuckDbEventLog(str(db), read_only=True) as log:
        return [ev for _, _, ev in log.read()]


def stack_of(name: str, engines: int, warmup_s: float):
    """The stack with its start split fitted to ``engines`` and the torch planner keywords."""
    st = get_stack(name)
    st = replace(st, planner_args={**st.planner_args, **PLANNER_ARGS}, prefill_order=LIVE_PREFILL_ORDER)
    return st, SimConfig(nodes=engines, warmup_s=warmup_s, duration_s=3600.0)


def write_sim_log(path: Path, events: list, config: dict) -> None:
    rec = SimLog(path, config=config)
    try:
        for i, e in enumerate(events, start=1):
            rec(i, e)
    finally:
        rec.close()


class Fidelity:
    """One ``evolving fidelity`` run (module docstring)."""

    def __init__(self, spec: FidelitySpec, console: Console) -> None:
        self.spec, self.console = spec, console
        self.out = Path(spec.out_dir) if spec.out_dir else Path(tempfile.mkdtemp(prefix="fidelity-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.scaling = scaling_of(spec)
        order = (f"prefill queue order {LIVE_PREFILL_ORDER} on both sides: the torch engines' "
                 "(a stack's simulated short_first is not in the live engines)")
        threads = (torch_engine_env(spec.engines) or os.environ)["OMP_NUM_THREADS"]
        cores = (f"torch engines with OMP_NUM_THREADS={threads} each (the cores split between them, as the "
                 "simulated nodes are separate GPUs that never slow each other)")
        self.notes: list[str] = [order, cores]

    def sessions(self):
        from replay.traces.importers.spec import load_workload  # lazy: evolving --help (the importers)

        real = load_workload(str(self.spec.trace)).sessions
        test = scaled_sessions(real, self.scaling)
        cal = scaled_sessions(real, replace(self.scaling, skip=0, sessions=self.spec.calibration_sessions))
        sweep = [int(x) for x in str(self.spec.calibration_sweep).split(",") if x.strip()]
        cal = [*prefill_sweep(sweep), *cal]
        if len(test) < self.scaling.sessions:
            self.notes.append(f"only {len(test)} sessions fit after the calibration ones (asked {self.scaling.sessions})")
        return cal, test

    async def calibrate(self, cal_sessions, progress, task) -> tuple[Any, str]:
        a = self.spec
        if a.profile:
            return load_profile(a.profile), f"profile {a.profile} (given)"
        log = Path(a.calibration_log) if a.calibration_log else None
        kept = self.out / "calibration" / "run.duckdb"
        if log is None and a.reuse_live and kept.exists():
            log = kept
        if log is None:
            st, cfg = stack_of("evolving", a.engines, a.warmup_s)
            conf = st.core_config(load_profile("gb300-glm52"), cfg)
            progress.update(task, description=f"calibration run (live evolving, {len(cal_sessions)} sessions)")
            lr = await run_live(st, conf, cal_sessions, engines=a.engines, concurrency=a.concurrency,
                                run_dir=self.out / "calibration", model=a.model, vocab=vocab_of(a.model))
            log = lr.db
        cal = calibrate_log(log)
        path = self.out / "calibrated.toml"
        path.write_text(profile_toml(cal, "calibrated-torch"))
        self.console.print(format_calibration(cal))
        return load_profile(str(path)), f"calibrated from {log} -> {path}"

    async def one_stack(self, name: str, profile, test_sessions) -> tuple[list[dict], dict]:
        a = self.spec
        st, cfg = stack_of(name, a.engines, a.warmup_s)
        conf = st.core_config(profile, cfg)
        safe = name.replace(":", "_").replace("+", "_")
        kept = self.out / f"live-{safe}" / "run.duckdb"
        if a.reuse_live and kept.exists():  # the simulator side again, on the live log already kept
            lr = LiveRun(name, kept, DriveReport(), float("nan"), float("nan"))
        else:
            lr = await run_live(st, conf, test_sessions, engines=a.engines, concurrency=a.concurrency,
                                run_dir=self.out / f"live-{safe}", model=a.model, vocab=vocab_of(a.model))
        live_events = read_events(lr.db)
        offset = planner_offset_s(live_events)
        warm = sim_warmup_s(a.warmup_s, offset)
        sim_events = run_sim(profile, st, test_sessions, nodes=a.engines, concurrency=a.concurrency, warmup_s=warm,
                             planner_args=PLANNER_ARGS, seed=a.seed)
        write_sim_log(self.out / f"sim-{safe}.duckdb", sim_events,
                      {"driver": "fidelity", "stack": st.describe(), "profile": profile.name, "nodes": a.engines,
                       "warmup_s": warm, **conf})
        live_m, sim_m = metrics_of(live_events, name), metrics_of(sim_events, name)
        info = {"stack": name, "live_log": str(lr.db), "sim_log": str(self.out / f"sim-{safe}.duckdb"),
                "ready_s": round(lr.ready_s, 1), "drive_s": round(lr.drive_s, 1),
                "requests_failed": len(lr.report.failed), "planner_offset_s": round(offset, 2),
                "sim_warmup_s": round(warm, 2), "unfinished_live": live_m.submitted - live_m.finished,
                "unfinished_sim": sim_m.submitted - sim_m.finished,
                "per_request": split_ratios(request_times(live_events), request_times(sim_events))}
        return rows(name, live_m, sim_m), info

    async def run(self) -> dict:
        a = self.spec
        cal_sessions, test = self.sessions()
        stacks = [s.strip() for s in a.stacks.split(",") if s.strip()]
        fig = workload_figures(test)
        self.console.print(f"scaling: {self.scaling.describe()}")
        self.console.print(f"test sessions: {fig['sessions']} sessions, {fig['requests']} requests, "
                           f"{fig['prompt_tokens']} prompt tokens, {fig['output_tokens']} output tokens; "
                           f"{a.engines} torch engines per stack")
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=self.console, transient=True)
        out_rows: list[dict] = []
        infos: list[dict] = []
        t0 = time.monotonic()
        with progress:
            task = progress.add_task("profile", total=1 + len(stacks))
            profile, prof_src = await self.calibrate(cal_sessions, progress, task)
            progress.advance(task)
            for name in stacks:
                progress.update(task, description=f"{name}: live run + simulation")
                r, info = await self.one_stack(name, profile, test)
                out_rows += r
                infos.append(info)
                progress.advance(task)
        live_rank, sim_rank = ranking(out_rows)
        return {"rows": out_rows, "stacks": infos, "scaling": asdict(self.scaling), "workload": fig,
                "profile": prof_src,
                "ranking": {"live": live_rank, "sim": sim_rank, "same": same_ranking(out_rows),
                            "tie_tolerance": TIE_TOLERANCE, "live_ties": ranked(live_rank, out_rows, "live"),
                            "sim_ties": ranked(sim_rank, out_rows, "sim")},
                "out_dir": str(self.out), "wall_s": round(time.monotonic() - t0, 1), "notes": self.notes}


def format_report(res: dict) -> str:
    lines = [f"profile: {res['profile']}",
             f"{'stack':<14} {'metric':<15} {'live':>10} {'sim':>10} {'sim/live-1':>11}"]
    for r in res["rows"]:
        d = off_by(r["live"], r["sim"])
        flag = " *" if d is not None and abs(d) > TOLERANCE and r["metric"] in GATED else ""
        fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(f"{r['stack']:<14} {r['metric']:<15} {fmt(r['live']):>10} {fmt(r['sim']):>10} "
                     f"{'-' if d is None else f'{d:+.0%}':>11}{flag}")
    rk = res["ranking"]
    lines.append(f"ranking by throughput: live {rk['live_ties']}; sim {rk['sim_ties']} "
                 f"({'same' if rk['same'] else 'different'}; '=' within {rk['tie_tolerance']:.0%} of the larger)")
    lines.append(f"* = off by more than {TOLERANCE:.0%} on a gated metric ({', '.join(GATED)})")
    for s in res["stacks"]:
        lines.append(f"{s['stack']}: live log {s['live_log']}, sim log {s['sim_log']}; up ready {s['ready_s']} s, "
                     f"drive {s['drive_s']} s, {s['requests_failed']} failed, unfinished live {s['unfinished_live']} / sim "
                     f"{s['unfinished_sim']}; sim warm-up {s['sim_warmup_s']} s")
    lines += [format_split(s["stack"], s["per_request"]) for s in res["stacks"] if "per_request" in s]
    lines += [f"note: {n}" for n in res["notes"]]
    return "\n".join(lines)


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(143)  # unwinds through run_live's finally: the live stack is stopped, not orphaned


def cmd_fidelity(spec: FidelitySpec) -> int:
    console = Console(stderr=True) if spec.json else Console()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    res = asyncio.run(Fidelity(spec, console).run())
    if spec.json:
        print(json.dumps(res, indent=2))
    else:
        console.print(format_report(res), highlight=False)
    return 0


def cmd_calibrate(spec: CalibrateSpec) -> int:
    cal = calibrate_log(spec.log)
    if cal.prefill is None and cal.decode is None:
        print(f"error: {spec.log}: no engine iterations to fit ({'; '.join(cal.notes)})", file=sys.stderr)
        return 1
    text = profile_toml(cal, spec.name or Path(spec.out).stem, base=spec.base)
    Path(spec.out).write_text(text)
    load_profile(spec.out)  # the file is one the simulator reads
    if spec.json:
        print(json.dumps({"calibration": asdict(cal), "out": spec.out}, indent=2, default=str))
    else:
        print(format_calibration(cal))
        print(f"wrote {spec.out} (evolving replay --profile {spec.out})")
    return 0

