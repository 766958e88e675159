"""One simulated run, the way every command runs it: :func:`run_one`.

``evolving replay`` / ``compare`` / ``sweep-static`` / ``bench sim`` (replay/sim/cli.py) and every
row of ``evolving experiments`` (replay/experiments/run.py) call it with their flags made a
:class:`~replay.sim.inputs.SimSpec`: the
profile with the KV flags, the stack composition, the simulator, and (given a path) the full event
log written to DuckDB through the recorder's :class:`~services.adapters.eventlog.DuckDbEventLog`
(the same code the live recorder uses), in batches, by a writer thread (replay/sim/simlog.py;
``--log-level decisions`` keeps only what the tables need). ``--partitions N`` hands the run to
replay/sim/partitioned.py.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from replay.sim.figures import MetricsFold, RunMetrics
from replay.sim.inputs import SimSpec, run_profile, sim_config
from replay.sim.partitioned import run_partitioned
from replay.sim.simlog import BATCH, SimLog
from replay.sim.simulation import SessionSource, Simulation
from replay.sim.stacks import get_stack
from services.adapters.eventlog.columnar import FORMAT


def run_one(stack_name: str, spec: SimSpec, source: SessionSource, out: Path | None, progress: bool = True,
            keep_log: bool = False) -> tuple[RunMetrics, object]:
    """One run: its figures (folded as the events are emitted, :class:`MetricsFold`) and its
    :class:`RunResult`. ``keep_log``: also keep every event in ``res.log`` (``bench sim``'s digest);
    otherwise the run holds no event past its fold and its log writer's batch, which is what
    bounds a long run's memory (an OSWorld-like row kept ~9 GB of events by its 64th minute)."""
    if spec.partitions > 1:  # one process per partition, merged log (replay/sim/partitioned.py)
        return run_partitioned(stack_name, spec, out, progress=progress)
    prof = run_profile(spec)
    cfg = sim_config(spec)
    stack = get_stack(stack_name, start=spec.start)
    rec = None
    if out is not None:  # --log-level; bench sim's baseline row: log_format "1", written in this thread, 20,000 a batch
        rec = SimLog(out, level=spec.log_level or "full", format=spec.log_format or FORMAT,
                     background=not spec.log_sync, batch=spec.log_batch or BATCH,
                     config={"driver": "simulator", "stack": stack.describe(), "profile": prof.name,
                              "kv_gpu_tokens": prof.l1_capacity_tokens, "kv_host_tokens": prof.l2_capacity_tokens,
                              "nodes": cfg.nodes, "seed": cfg.seed, "warmup_s": cfg.warmup_s,
                              "duration_s": cfg.duration_s, "agents": cfg.agents,
                              "arrivals_per_min": cfg.arrivals_per_min, **stack.core_config(prof, cfg)})
    fold = MetricsFold(cfg.warmup_s, cfg.end_s)
    sim = Simulation(prof, stack, source, cfg, record=rec, keep_log=keep_log, observe=fold)
    t0, c0 = time.perf_counter(), time.process_time()
    bar = None
    if progress:
        bar = Progress(TextColumn("[bold]{task.fields[stack]}"), BarColumn(), TextColumn("{task.fields[info]}"),
                       TimeElapsedColumn(), transient=True)
        task = bar.add_task("sim", total=cfg.end_s, stack=stack.name, info="")

        def on_tick(now: float, s: Simulation) -> None:
            if int(now) % 10:
                return
            roles = [n.role for n in s.nodes.values()]
            split = f"{roles.count('prefill')}P{roles.count('decode')}D" + (
                f"{roles.count('collocated')}C" if "collocated" in roles else "")
            bar.update(task, completed=now, info=f"t={now / 60:5.1f} min  done={s.finished}  split={split}")

        sim.progress = on_tick
        bar.start()
    try:
        with _frozen_heap(source):
            res = sim.run()
    finally:
        if bar is not None:
            bar.stop()
        if rec is not None:
            rec.close()
    res.wall_s = time.perf_counter() - t0
    res.cpu_s = time.process_time() - c0
    if rec is not None:
        res.log_stats = rec.stats()
    m = fold.metrics(stack.name)
    m.unfinished = len(res.unfinished)
    return m, res


@contextmanager
def _frozen_heap(source: SessionSource) -> Iterator[None]:
    """The run with every object alive at its start (the sessions: a real trace's ~10^7 block
    hashes, the imports) out of the cyclic collector's reach, given back after it. Each full
    collection traversed them all, and the sessions generated during a run got traversed again
    by every young collection: ~3-5% of a run's CPU (docs/simulator.md §8, third pass). The
    collector's other work is unchanged (new objects are collected as before), and nothing
    the simulation decides depends on it. ``source`` freezes the sessions it generates meanwhile
    (:meth:`SessionSource._made`). A heap its caller froze (a server's start-up objects) is
    left alone: ``gc.unfreeze`` would give back the caller's objects too."""
    if gc.get_freeze_count():  # walks the frozen objects: once a run
        yield
        return
    gc.freeze()
    was, source.frozen = source.frozen, True
    try:
        yield
    finally:
        source.frozen = was
        gc.unfreeze()


def default_jobs() -> int:
    """Runs at a time (``compare``'s stacks, ``experiments``' rows): the cores this process may
    use, at most 2 (each run is one process)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(2, n))
