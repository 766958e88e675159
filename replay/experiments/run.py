"""``evolving experiments``' runner: each row of the matrix (replay/experiments/matrix.py) run once.

Each run is one ``replay.sim.runs.run_one`` call (the same code ``evolving replay`` / ``compare``
use: session source, profile with the KV flags, stack composition, the DuckDB recorder) with its
own command-line flags, parsed by the same parser ``compare`` uses. One DuckDB event log per run
goes to ``OUT_DIR/<experiment>/<run>.duckdb``; identical rows run once (:func:`run_key`), rows
run in worker processes (``--jobs``) or as tasks of any other executor (``--ray ADDRESS``: Ray
tasks, services/adapters/executors.py; the log written on the worker's machine and shipped back,
:func:`execute_shipped`), and each experiment is reported (replay/experiments/plots.py) as soon as
its rows are done.

A row that needs a piece the simulator does not have yet says ``not available: needs X``
instead of running something else under its name.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import msgspec
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replay.experiments.matrix import Experiment, Run
from replay.sim import stacks
from replay.sim.cli import add_run_args, sim_spec
from replay.sim.figures import METRIC_TYPES, RunMetrics, compute_metrics
from replay.sim.inputs import run_profile, session_source
from replay.sim.runs import run_one
from replay.sim.simulation import SessionSource, Simulation
from replay.traces.pacing import pace_session, parse_pace
from replay.traces.workloads import WORKLOADS


# --------------------------------------------------------------------------- availability
def run_parser() -> argparse.ArgumentParser:
    """The flags of one matrix run (those of `evolving replay`), for reading a run's argv back."""
    p = argparse.ArgumentParser(prog="evolving experiments (one run)")
    add_run_args(p, default_duration="1h", default_warmup="30m")
    return p


def missing_piece(run: Run, parser: argparse.ArgumentParser) -> str:
    """Why ``run`` cannot run here ("" when it can): a flag or stack part not built yet."""
    opts = {o for a in parser._actions for o in a.option_strings}
    for flag in (a for a in run.argv if a.startswith("--")):
        if flag not in opts:
            need = {"--kv-gpu-tokens": "KV capacity flags",
                    "--kv-host-tokens": "KV capacity flags",
                    "--pace": "agent pacing",
                    "--start": "--start for every stack"}.get(flag, flag)
            return f"needs {need}"
    start = run.argv[run.argv.index("--start") + 1] if "--start" in run.argv else None
    try:
        st = stacks.get_stack(run.stack, start=start)
    except (KeyError, ValueError) as exc:
        part = "data plane as a stack choice" if "+" in run.stack else str(exc)
        return f"needs {part}"
    if start is not None and st.planner == "evolving" and getattr(st, "start", None) is None:
        return "needs --start honoured by the evolving stack"
    if run.schedule is not None and not hasattr(Simulation, "bind_source_clock"):
        return "needs the simulator's session-clock hook (replay/sim/simulation.py)"
    return ""


# --------------------------------------------------------------------------- sources
class ScheduleSource(SessionSource):
    """A shifting composition: the workload of session ``k`` is the mix in force when it
    starts (the simulator binds the clock). ``mixed`` alternates Putnam and OSWorld sessions."""

    def __init__(self, schedule: list[tuple[float, str]], seed: int) -> None:
        super().__init__(make=self._make)
        self.schedule = sorted(schedule)
        self.seed = seed
        self.clock: Callable[[], float] = lambda: 0.0
        self.started: list[tuple[float, str]] = []  # (time, workload) per session, for the report

    def bind_clock(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def mix_at(self, t: float) -> str:
        mix = self.schedule[0][1]
        for start, name in self.schedule:
            if t >= start:
                mix = name
        return mix

    def _make(self, k: int):
        t = self.clock()
        mix = self.mix_at(t)
        name = ("putnam", "osworld")[k % 2] if mix == "mixed" else mix
        self.started.append((t, name))
        w = WORKLOADS[name]
        rng = np.random.Generator(np.random.PCG64([self.seed, k]))
        return pace_session(w.make(f"{name}-s{self.seed}-{k:05d}", rng, w.params), parse_pace("agent"))


@contextlib.contextmanager
def _registered(run: Run) -> Iterator[str]:
    """The stack spec to hand ``run_one``: ``run.stack`` itself, or, with planner overrides, a
    preset registered for the duration of the run (``replay.sim.stacks.PRESETS`` is the registry
    ``get_stack`` reads)."""
    if not run.planner_args:
        yield run.stack
        return
    base = stacks.get_stack(run.stack)
    key = "experiment-" + re.sub(r"[^a-z0-9]+", "-", run.label.lower()).strip("-")
    stacks.PRESETS[key] = replace(base, name=key, planner_args={**base.planner_args, **run.planner_args})
    try:
        yield key
    finally:
        stacks.PRESETS.pop(key, None)


# --------------------------------------------------------------------------- running
@dataclass
class Result:
    run: Run
    metrics: RunMetrics | None
    status: str  # "ok" or "not available: needs ..."
    wall_s: float = 0.0
    log: str = ""
    sessions: dict[str, int] = field(default_factory=dict)  # shifting: sessions per workload per phase
    same_as: str = ""  # "exp / label" of the identical row whose run this reuses
    cpu_s: float = 0.0  # CPU seconds of the process that ran it
    resumed: bool = False  # read back from the log an earlier call wrote (--resume), not run now
    ran_on: str = ""  # "HOST pid N": the process that ran it (a worker, a Ray task's node)


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def _here() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


def execute(run: Run, log: str, seed: int = 0, progress: bool = False) -> Result:
    """Run one row (in this process or a worker of the pool): ``run_one`` with the row's flags,
    its event log written to ``log``. An exception is the row's status (``failed: ...``), never
    the end of the matrix."""
    parser = run_parser()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        opts = sim_spec(parser.parse_args([*run.argv, "--seed", str(seed)]))
        source: SessionSource
        if run.schedule is not None:
            source = ScheduleSource(run.schedule, seed)
        else:
            source, _ = session_source(opts)
        with _registered(run) as spec:
            m, _ = run_one(spec, opts, source, Path(log), progress=progress)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the row's status (a bad --trace exits), the matrix goes on
        msg = " ".join(str(exc).split())[:300]
        return Result(run, None, f"failed: {type(exc).__name__}: {msg}", time.perf_counter() - t0, "",
                      cpu_s=time.process_time() - c0, ran_on=_here())
    m.stack = run.label
    r = Result(run, m, "ok", time.perf_counter() - t0, log, cpu_s=time.process_time() - c0, ran_on=_here())
    if isinstance(source, ScheduleSource):
        for t, name in source.started:
            key = f"{source.mix_at(t)}: {name}"
            r.sessions[key] = r.sessions.get(key, 0) + 1
    return r


def execute_shipped(run: Run, log: str, seed: int = 0) -> tuple[Result, dict[str, bytes]]:
    """:func:`execute` on a machine that need not see ``log``'s folder (a Ray worker): the row's
    log goes to a temporary folder there and comes back as bytes, ``{suffix: bytes}`` for the
    log file and any file beside it that DuckDB left (``.wal``), which :func:`land` writes at
    ``log`` on the driver's side. The run is the same call, so the same events (a test compares
    the digests with a local run)."""
    with tempfile.TemporaryDirectory(prefix="ei-row-") as tmp:
        local = Path(tmp) / Path(log).name
        r = execute(run, str(local), seed, False)
        files = {f.name[len(local.name):]: f.read_bytes() for f in sorted(Path(tmp).iterdir())
                 if f.is_file() and f.name.startswith(local.name)}
    if r.status == "ok":
        r.log = log
    return r, files


def land(shipped: tuple[Result, dict[str, bytes]], log: str) -> Result:
    """Write a shipped row's files at ``log`` (each through a temporary name, then renamed: a
    reader never sees half a log) and return its result."""
    r, files = shipped
    for suffix, data in files.items():
        dest = Path(log + suffix)
        part = dest.with_name(dest.name + ".part")
        part.write_bytes(data)
        os.replace(part, dest)
    return r


def log_digest(path: str) -> tuple[int, str]:
    """(events, sha256) of a DuckDB event log's events in order: their seq, subject, type and
    msgpack encoding, whatever the log's on-disk format. Two rows with equal digests made the
    same run, decision for decision (a row run on Ray against the same row run here)."""
    from services.adapters.eventlog import DuckDbEventLog  # lazy: only tests and benchmarks digest logs

    enc, h, n = msgspec.msgpack.Encoder(order="deterministic"), hashlib.sha256(), 0
    ev_log = DuckDbEventLog(path, read_only=True)
    try:
        for seq, subject, ev in ev_log.read():
            h.update(f"{seq} {subject} {type(ev).__name__} ".encode())
            h.update(enc.encode(ev))
            n += 1
    finally:
        ev_log.close()
    return n, h.hexdigest()


def run_key(run: Run, parser: argparse.ArgumentParser) -> str:
    """What makes two rows the same simulation: the stack, planner overrides, schedule and every
    parsed flag, with the KV flags resolved into the profile's capacities (``--kv-gpu-tokens 5M``
    on a 5M profile is the default run). Equal keys run once; the later row reuses the result."""
    a = parser.parse_args(run.argv)
    prof = run_profile(sim_spec(a))
    flags = {k: v for k, v in sorted(vars(a).items())
             if k not in ("kv_gpu_tokens", "kv_host_tokens", "profile", "no_progress", "json")}
    return json.dumps([run.stack, sorted(run.planner_args.items()), run.schedule, flags, prof.name,
                       prof.l1_capacity_tokens, prof.l2_capacity_tokens], default=str)


#: How many more times a row runs after its worker process died under it (the pool broke).
POOL_RETRIES = 1
#: How long a broken pool may take to fail the rows it still held (its manager thread does it).
BROKEN_POOL_SETTLE_S = 30.0


def _submit(pool: Executor, run: Run, log: str, seed: int, ship: bool) -> Future:
    """The row as a job of ``pool``: a future of its :class:`Result`, its log at ``log`` (written
    there by the job, or, ``ship``, shipped back and written here before the future is done)."""
    if not ship:
        return pool.submit(execute, run, log, seed, False)
    inner = pool.submit(execute_shipped, run, log, seed)
    outer: Future = Future()

    def landed(f: Future) -> None:
        if f.cancelled():
            outer.cancel()
            return
        try:
            outer.set_result(land(f.result(), log))
        except BaseException as exc:  # noqa: BLE001 - the job's failure, or a failed write, is the row's
            outer.set_exception(exc)

    inner.add_done_callback(landed)
    return outer


def _result_of(fut: Future, run: Run) -> Result:
    """A pooled row's result; a job that ended without one (its worker or node died, a shipped log
    could not be written) is the row's ``failed: ...`` status, as a row that raised in
    :func:`execute`, never the end of the matrix."""
    try:
        return fut.result()
    except Exception as exc:  # noqa: BLE001 - the row's status; the matrix goes on
        msg = " ".join(str(exc).split())[:300]
        return Result(run, None, f"failed: {type(exc).__name__}: {msg}")


def _rows_bar(futures, console) -> Progress:
    """A bar of the simulations done out of those submitted to a pool, advanced as each ends."""
    futures = list(futures)
    bar = Progress(TextColumn("[bold]simulations done"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True)
    task = bar.add_task("rows", total=len(futures))
    bar.start()
    for f in futures:
        f.add_done_callback(lambda _f: bar.advance(task))
    return bar


def _row_line(tag: str, exp: Experiment, r: Result) -> str:
    head = f"{tag}{exp.name} / {r.run.label} ({r.run.stack})"
    if r.metrics is None:
        return f"{head}: [yellow]{r.status}"
    m = r.metrics
    return (f"{head}: {m.throughput_rps:.2f} req/s, TTFT P95 {m.ttft_p95_s:.2f} s, "
            f"{r.wall_s:.0f} s wall, {r.cpu_s:.0f} s CPU" + (f" (same run as {r.same_as})" if r.same_as else "")
            + (" (read back from an earlier run's log)" if r.resumed else "") + f" -> {r.log}")


def _key_file(log: str) -> Path:
    return Path(log + ".key")


def recorded(log: str, key: str, seed: int) -> Result | None:
    """The row ``log`` already holds (``--resume``): its key file says the same simulation (:func:`run_key`,
    seed) ran to the end into it, so its metrics are recomputed from the log alone, as ``sim-report``
    does. None when there is no such run (no log, no key file, another key: the row runs again)."""
    kf = _key_file(log)
    if not (Path(log).exists() and kf.exists()):
        return None
    try:
        doc = json.loads(kf.read_text())
    except (OSError, ValueError):
        return None
    if doc.get("key") != key or doc.get("seed") != seed:
        return None
    from services.adapters.eventlog import DuckDbEventLog  # lazy: only when resuming

    ev_log = DuckDbEventLog(log, read_only=True)
    try:
        cfg = ev_log.run_config()
        warm, dur = float(cfg["warmup_s"]), float(cfg["duration_s"])
        m = compute_metrics((ev for _, _, ev in ev_log.read(types=METRIC_TYPES)), warm, warm + dur, doc["label"])
    finally:
        ev_log.close()
    m.unfinished = int(doc.get("unfinished", 0))
    return Result(Run(doc["label"], doc["stack"], []), m, "ok", float(doc.get("wall_s", 0.0)), log,
                  dict(doc.get("sessions", {})), cpu_s=float(doc.get("cpu_s", 0.0)), resumed=True)


def _keep(r: Result, key: str, seed: int) -> None:
    """After a row ran to the end: its key file beside its log, for ``--resume``."""
    if r.status == "ok" and r.log:
        _key_file(r.log).write_text(json.dumps({
            "key": key, "seed": seed, "label": r.run.label, "stack": r.run.stack, "wall_s": r.wall_s,
            "cpu_s": r.cpu_s, "sessions": r.sessions, "unfinished": getattr(r.metrics, "unfinished", 0)}))


def run_matrix(exps: list[Experiment], out_dir: Path, console, *,
               report: Callable[[Experiment, list[Result], Path, object, bool], dict], jobs: int = 1,
               progress: bool = False, seed: int = 0, quick: bool = False,
               on_experiment: Callable[[list[dict]], None] | None = None, resume: bool = False,
               executor: Executor | None = None, ship_logs: bool = False) -> list[dict]:
    """Every row of ``exps``: available rows run once each (identical rows once in all, see
    :func:`run_key`), ``jobs`` at a time in worker processes (1: here, in order), or, given an
    ``executor`` (a Ray cluster's, services/adapters/executors.py), as its jobs, however many it
    runs at a time; ``ship_logs``: each row's log is written where its job runs and shipped back
    (:func:`execute_shipped`), for executors whose workers cannot write ``out_dir``. The executor
    is shut down at the end. ``progress``: a bar per run (here) or of the simulations done (a
    pool). Each experiment
    is reported as soon as its rows are done, the first in the matrix's order among those done:
    ``report(exp, results, out_dir, console, quick)`` (replay.experiments.plots.report: its
    table and plots) returns its JSON summary (then ``on_experiment(summaries so far)``); rows
    are submitted in the matrix's order.
    Returns the experiments' JSON summaries. Interrupted (Ctrl-C, SIGTERM), the workers are
    stopped and the experiments done so far stay reported. ``resume``: a row whose log already
    holds the same simulation run to the end (:func:`recorded`) is read back, not run again."""
    parser = run_parser()
    total = sum(len(e.runs) for e in exps)
    plan: list[tuple[Experiment, Run, str, str]] = []  # (exp, run, log, status or key)
    first: dict[str, tuple[str, str]] = {}  # key -> (log, "exp / label") of the row that runs it
    for exp in exps:
        (out_dir / exp.name).mkdir(parents=True, exist_ok=True)
        for run in exp.runs:
            why = missing_piece(run, parser)
            log = str(out_dir / exp.name / f"{safe(run.label)}.duckdb")
            if why:
                plan.append((exp, run, log, f"not available: {why}"))
                continue
            key = run_key(run, parser)
            first.setdefault(key, (log, f"{exp.name} / {run.label}"))
            plan.append((exp, run, log, key))
    done: dict[str, Result] = {}
    if resume:
        for _exp, _run, log, key in plan:
            if key in first and first[key][0] == log and (old := recorded(log, key, seed)) is not None:
                old.run, old.same_as = _run, ""
                done[key] = old
    pool: Executor | None = executor
    own_pool = pool is None and jobs > 1

    def new_pool() -> Executor:
        return ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))

    if own_pool:
        pool = new_pool()
    futures: dict[str, Future] = {}
    rows_of: dict[str, tuple[Run, str]] = {}  # key -> (run, log) of the row that runs it
    resubmitted: dict[str, int] = {}

    def submit(key: str, run: Run, log: str) -> Future:
        fut = _submit(pool, run, log, seed, ship_logs)
        # the key file as soon as the row ends, not when its experiment is reported: a matrix
        # stopped mid-experiment resumes without re-running rows that had finished
        fut.add_done_callback(lambda f, k=key: None if f.cancelled() or f.exception() is not None
                              else _keep(f.result(), k, seed))
        futures[key], rows_of[key] = fut, (run, log)
        return fut

    if pool is not None:
        for _exp, _run, log, key in plan:
            if key in first and first[key][0] == log and key not in futures and key not in done:
                submit(key, _run, log)

    def retriable(key: str) -> bool:
        """The row's job ended because the pool's worker process died, and it may run again."""
        f = futures[key]
        return (own_pool and f.done() and not f.cancelled() and isinstance(f.exception(), BrokenProcessPool)
                and resubmitted.get(key, 0) < POOL_RETRIES)

    def revive() -> None:
        """A worker process that dies (the kernel's OOM killer, a crash) breaks a process pool:
        every row it still held fails with ``BrokenProcessPool``, the rows that never started
        included. Those rows go to a fresh pool, each at most :data:`POOL_RETRIES` times more;
        past that a row keeps its ``failed: BrokenProcessPool`` status and the matrix goes on."""
        nonlocal pool
        if not any(retriable(k) for k in futures):
            return
        # a broken pool fails all it held from its manager thread: let it finish that first, so
        # no row of the old pool is still pending when the fresh one takes the rows again
        wait([f for f in futures.values() if not f.done()], timeout=BROKEN_POOL_SETTLE_S)
        again = [k for k in futures if retriable(k)]
        old, pool = pool, new_pool()
        old.shutdown(wait=False, cancel_futures=True)
        console.print(f"evolving experiments: a worker process died (killed, or out of memory); "
                      f"{len(again)} row(s) submitted again to a fresh pool of {jobs}")
        for k in again:
            resubmitted[k] = resubmitted.get(k, 0) + 1
            fut = submit(k, *rows_of[k])
            if bar is not None:
                bar.update(bar.task_ids[0], total=bar.tasks[0].total + 1)
                fut.add_done_callback(lambda _f: bar.advance(bar.task_ids[0]))
    summaries: list[dict] = []
    index = {id(run): k for k, (_e, run, _l, _k) in enumerate(plan, start=1)}

    def row(exp: Experiment, run: Run, log: str, key: str) -> Result:
        if key.startswith("not available"):
            r = Result(run, None, key)
        elif first[key][0] != log:  # the same simulation as another row (reported or not yet)
            src = done[key] if key in done else _result_of(futures[key], run)
            m = replace(src.metrics, stack=run.label) if src.metrics is not None else None
            r = Result(run, m, src.status, 0.0, src.log, dict(src.sessions), same_as=first[key][1])
        elif key in done:
            r = done[key]
        else:
            if pool is None:
                console.print(f"[{index[id(run)]}/{total}] {exp.name} / {run.label} ({run.stack}) ...")
                r = execute(run, log, seed, progress)
                _keep(r, key, seed)
            else:
                r = _result_of(futures[key], run)
                r.run = run
            done[key] = r
        say(exp, run, r)
        return r

    announced: set[int] = set()  # rows whose line is printed (each once)

    def say(exp: Experiment, run: Run, r: Result) -> None:
        if id(run) not in announced:
            console.print(_row_line(f"[{index[id(run)]}/{total}] ", exp, r))
            announced.add(id(run))

    def announce() -> None:
        """A row's line as soon as its worker finishes, not only when its whole experiment is
        reported (a 5-row experiment at 2 workers printed nothing for hours)."""
        for exp, run, log, key in plan:
            fut = futures.get(key)
            if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None \
                    or first[key][0] != log:
                continue
            r = fut.result()
            r.run = run
            say(exp, run, r)

    def ready(exp: Experiment) -> bool:
        return pool is None or all(k not in futures or (futures[k].done() and not retriable(k))
                                   for e, _r, _l, k in plan if e is exp)

    pending = list(exps)
    order = {e.name: k for k, e in enumerate(exps)}
    bar = _rows_bar(futures.values(), console) if progress and futures else None
    try:
        while pending:  # with workers: each experiment reported as soon as its rows are done
            revive()
            exp = next((e for e in pending if ready(e)), None)
            if exp is None:
                wait([f for f in futures.values() if not f.done()], return_when=FIRST_COMPLETED)
                announce()
                continue
            pending.remove(exp)
            results = [row(e, run, log, key) for e, run, log, key in plan if e is exp]
            summaries.append(report(exp, results, out_dir, console, quick))
            summaries.sort(key=lambda d: order[d["name"]])  # summary.json in the matrix's order
            if on_experiment is not None:
                on_experiment(summaries)
    finally:
        if bar is not None:
            bar.stop()
        if pool is not None:
            procs = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:  # a row still running when interrupted: stop it, do not leave it behind
                if proc.is_alive():
                    proc.terminate()
    return summaries


# --------------------------------------------------------------------------- reporting
