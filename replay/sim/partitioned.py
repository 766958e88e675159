"""The simulator on a partitioned cluster: one process per partition, one merged log.

``evolving replay|compare --partitions N [--jobs J]`` (docs/partitions.md, docs/simulator.md):

1. The cluster's ``--nodes`` are split into ``N`` contiguous blocks (services/cores/partitions.py);
   a partition keeps the cluster's node ids (``n000`` .. ``n767``).
2. Sessions: the pool of agent sessions is the single run's pool (session ``k`` is the same
   session, named ``a<k>:…``, whatever ``N``); agent ``k`` belongs to the partition
   ``PartitionMap.session_index("a<k>")`` (a stable hash of the agent id, the stem of its root
   branch id ``a<k>:<session>/<root>``; every fork and sub-agent of the session carries it, so
   it runs where its root runs). Each partition draws, in pool order, the agents that hash to
   it. The closed-loop concurrency (``--agents``) or the open arrival rate (``--arrivals``) is
   split in proportion to the partitions' node counts (largest remainder, ties to the first).
3. Each partition is simulated alone, in its own process (at most ``--jobs``, default one per
   core available): its nodes, its sessions, its own directory, planner and router, seeded with
   ``seed + index * 1_000_003`` (one partition: the run seed, so ``--partitions 1`` is the plain
   run). Nothing crosses partitions (docs/partitions.md, the cross-partition rule).
4. Each process records its events on its partition's subjects (``ei.<p>.…``) into its own
   DuckDB file; the merge writes one DuckDB log ordered by ``(ts, partition index, seq within
   the partition)`` and renumbered 1..n. The order is a function of the partition logs alone,
   so the merged log is the same for any ``--jobs`` and any run; a partition's events, read back
   from the merged log, are its own log in its own order (event times never go back inside a
   partition).
5. The figures (and compare's plots) are those of the merged log, like any run's: they are
   folded from the partition logs read in the merge's order (``merged_events``) while DuckDB
   writes the merged log in a thread beside them (its query runs without the GIL), so the
   two serial steps after the simulation overlap.
"""

from __future__ import annotations

import heapq
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import duckdb
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from replay.sim.figures import METRIC_TYPES, SPLIT_TYPES, compute_metrics, split_figures
from replay.sim.inputs import SimSpec, run_profile, session_source, sim_config
from replay.sim.simlog import SimLog
from replay.sim.simulation import RunResult, SessionSource, SimConfig, Simulation
from replay.sim.stacks import get_stack
from services.adapters.eventlog import DuckDbEventLog, EventLogError
from services.adapters.eventlog.columnar import FORMAT
from services.adapters.logging import get_logger
from services.cores.partitions import PartitionMap

SEED_STRIDE = 1_000_003
MERGE_ORDER = "(ts, partition index, seq within the partition)"


def node_ids(total: int) -> list[str]:
    """The cluster's node ids: ``n00`` .. for up to 100 nodes, wider beyond (``n000`` .. ``n767``)."""
    width = max(2, len(str(total - 1)))
    return [f"n{i:0{width}d}" for i in range(total)]


def cluster_map(total_nodes: int, partitions: int) -> PartitionMap:
    return PartitionMap.contiguous(node_ids(total_nodes), partitions)


def split_share(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder, ties to the first)."""
    w = sum(weights)
    exact = [total * x / w for x in weights]
    out = [int(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


class PartitionSource(SessionSource):
    """The agents of one partition: the ``j``-th start is the ``j``-th pool index ``k`` (in
    order) whose agent id ``a<k>`` hashes to this partition; it keeps ``a<k>`` as its label."""

    def __init__(self, base: SessionSource, pmap: PartitionMap, index: int) -> None:
        self.base, self.pmap, self.index = base, pmap, index
        self._ks: list[int] = []
        self._scan = 0

    @property
    def make_s(self) -> float:  # type: ignore[override]
        return self.base.make_s

    def pool_index(self, j: int) -> int:
        while len(self._ks) <= j:
            k = self._scan
            self._scan += 1
            if self.pmap.session_index(f"a{k}") == self.index:
                self._ks.append(k)
        return self._ks[j]

    def label(self, k: int) -> str:
        return f"a{self.pool_index(k)}"

    def get(self, k: int):
        return self.base.get(self.pool_index(k))


def partition_config(cfg: SimConfig, pmap: PartitionMap, index: int) -> SimConfig:
    """Partition ``index``'s share of the cluster's run configuration (module docstring, 2-3)."""
    sizes = [len(ns) for ns in pmap.nodes]
    if len(pmap) == 1:
        return cfg
    agents = None if cfg.agents is None else split_share(int(cfg.agents), sizes)[index]
    arrivals = None if cfg.arrivals_per_min is None else cfg.arrivals_per_min * sizes[index] / sum(sizes)
    return replace(cfg, nodes=sizes[index], node_ids=tuple(pmap.nodes[index]), agents=agents,
                   arrivals_per_min=arrivals, seed=cfg.seed + index * SEED_STRIDE)


@dataclass
class PartitionRun:
    result: RunResult
    events: int  # the partition's log length (kept in memory only with keep_log)
    make_s: float  # wall time spent generating sessions

    @property
    def log(self) -> list:
        return self.result.log

    @property
    def finished(self) -> int:
        return self.result.finished


def simulate_partition(stack_name: str, spec: SimSpec, partitions: int, index: int, out: Path | None = None,
                       keep_log: bool = False) -> PartitionRun:
    """Simulate partition ``index`` of ``partitions`` alone (in this process)."""
    pmap = cluster_map(spec.nodes, partitions)
    base, _ = session_source(spec)
    source = base if partitions == 1 else PartitionSource(base, pmap, index)
    cfg = partition_config(sim_config(spec), pmap, index)
    stack = get_stack(stack_name, start=spec.start)
    rec = SimLog(out, pmap.names[index], level=spec.log_level or "full") if out is not None else None
    sim = Simulation(run_profile(spec), stack, source, cfg, record=rec, keep_log=keep_log)
    t0 = time.perf_counter()
    try:
        res = sim.run()
    finally:
        if rec is not None:
            rec.close()
    res.wall_s = time.perf_counter() - t0
    return PartitionRun(res, sim.seq, base.make_s)


def _worker(task: tuple) -> dict:
    stack_name, spec, partitions, index, out = task
    run = simulate_partition(stack_name, spec, partitions, index, Path(out))
    res = run.result
    return {"index": index, "wall_s": res.wall_s, "events": run.events, "submitted": res.submitted,
            "finished": res.finished, "unfinished": len(res.unfinished), "make_s": run.make_s,
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float | None:
    """This process's peak resident memory (``VmHWM``, MB; None where /proc is absent). Not
    ``ru_maxrss``: a spawned child's counts its parent's memory at the fork before the exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def partition_figures(source, pmap: PartitionMap, warmup_s: float, end_s: float) -> dict[str, dict]:
    """Per partition, ``split_figures`` of its nodes' events (read without the block-carrying
    events: a few seconds for the 768-node run). ``source``: a merged log (an ``EventLog``),
    or the partition logs' paths in partition order."""
    if isinstance(source, (list, tuple)):
        return {name: split_figures(merged_events([path], SPLIT_TYPES), warmup_s, end_s)
                for name, path in zip(pmap.names, source, strict=True)}
    by_part: dict[str, list] = {name: [] for name in pmap.names}
    for _, _, ev in source.read(types=SPLIT_TYPES):
        by_part[pmap.partition_of_node(ev.node)].append(ev)
    return {name: split_figures(evs, warmup_s, end_s) for name, evs in by_part.items()}


def merged_events(parts: Sequence[Path], types=None):
    """The events of the partition logs ``parts`` in the merged log's order, ``(ts, partition
    index, seq)`` (``types``: only these event types, as ``EventLog.read``), without writing the
    merged log. Each partition's log is in time order by seq (event times never go back inside
    a partition), so a k-way merge of the logs read by seq is the merged order."""
    logs = [DuckDbEventLog(str(p), read_only=True) for p in parts]
    try:
        def keyed(i: int, log):  # (ts, partition index, seq, event); i bound per stream
            for seq, _, ev in log.read(types=types):
                yield ev.ts, i, seq, ev

        streams = [keyed(i, log) for i, log in enumerate(logs)]
        for _, _, _, ev in heapq.merge(*streams, key=lambda row: row[:3]):
            yield ev
    finally:
        for log in logs:
            log.close()


def merge_logs(parts: Sequence[Path], out: Path, config: dict) -> int:
    """One DuckDB log from the partitions' logs, ordered by ``(ts, partition index, seq)`` and
    renumbered 1..n; returns n. Format 3 (services/adapters/eventlog/columnar.py): the block
    dictionaries are concatenated (partition ``i``'s ids shifted by the sizes before it, rounded
    up to a multiple of 64) and the runs and bitmap words of every event shifted with them, all
    in DuckDB."""
    if out.exists():
        out.unlink()
    log = DuckDbEventLog(str(out))
    log.set_run_config(config)
    log.close()
    con = duckdb.connect(str(out))
    try:
        sizes = []
        for i, p in enumerate(parts):
            part = DuckDbEventLog(str(p), read_only=True)
            fmt = part.format
            part.close()
            if fmt != FORMAT:
                raise EventLogError(f"{p}: a partition log of format {fmt}; the merge reads format {FORMAT}")
            path = str(p).replace("'", "''")
            con.execute(f"ATTACH '{path}' AS part{i} (READ_ONLY)")
            sizes.append(con.execute(f"SELECT count(*) FROM part{i}.block_dict").fetchone()[0])
        # each part's ids start at a multiple of 64 (format 3's bitmaps number words, id // 64);
        # the ids between parts are filler rows (hash 0, never referenced): ids stay dense
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(-(-(offsets[-1] + n) // 64) * 64)
        union = " UNION ALL ".join(
            f"SELECT {i} AS part, seq, ts, type, src, subject, payload, "
            f"CAST(list_transform(block_starts, lambda x: x + {offsets[i]}) AS UINTEGER[]) AS block_starts, "
            f"block_lens, block_segs, "
            f"CAST(list_transform(bitmap_words, lambda x: x + {offsets[i] // 64}) AS UINTEGER[]) AS bitmap_words, "
            f"bitmap_segs, bitmap_bits FROM part{i}.event_rows" for i in range(len(parts)))
        con.execute("BEGIN")
        for i in range(len(parts)):
            con.execute(f"INSERT INTO block_dict SELECT CAST(id + {offsets[i]} AS UINTEGER), hash "
                        f"FROM part{i}.block_dict ORDER BY id")
            if i + 1 < len(parts) and offsets[i] + sizes[i] < offsets[i + 1]:
                con.execute(f"INSERT INTO block_dict SELECT CAST(range AS UINTEGER), 0::UBIGINT "
                            f"FROM range({offsets[i] + sizes[i]}, {offsets[i + 1]})")
        con.execute("INSERT INTO event_rows SELECT CAST(row_number() OVER (ORDER BY ts, part, seq) AS UBIGINT), "
                    f"ts, type, src, subject, payload, block_starts, block_lens, block_segs, bitmap_words, "
                    f"bitmap_segs, bitmap_bits FROM ({union}) ORDER BY ts, part, seq")
        (n,) = con.execute("SELECT count(*) FROM event_rows").fetchone()
        con.execute("UPDATE log_meta SET value = ? WHERE key = 'applied_seq'", [str(n)])
        con.execute("COMMIT")
        for i in range(len(parts)):
            con.execute(f"DETACH part{i}")
    finally:
        con.close()
    return int(n)


@dataclass
class PartitionedResult:
    """What ``run_one`` callers read of a run: ``log`` is the merged log's sequence numbers (the
    events themselves are in the DuckDB file)."""

    stack: str
    config: SimConfig
    submitted: int
    finished: int
    events: int
    wall_s: float
    parts: list[dict]
    out: Path | None

    @property
    def log(self) -> range:
        return range(1, self.events + 1)

    @property
    def unfinished(self) -> list[str]:
        return [""] * sum(p["unfinished"] for p in self.parts)


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_partitioned(stack_name: str, spec: SimSpec, out: Path | None, progress: bool = True):
    """Every partition in parallel processes, merged into ``out`` (or a temporary file);
    returns ``(RunMetrics, PartitionedResult)`` from the merged log."""
    log = get_logger("partitions")
    n = int(spec.partitions)
    if n > spec.nodes:
        raise SystemExit(f"evolving: --partitions {n} needs at least {n} nodes (one per partition), "
                         f"got --nodes {spec.nodes}")
    pmap = cluster_map(spec.nodes, n)
    jobs = max(1, min(n, int(spec.jobs or default_jobs())))
    cfg = sim_config(spec)
    tmp = Path(tempfile.mkdtemp(prefix="ei-partitions-"))
    final = out if out is not None else tmp / "merged.duckdb"
    parts = [tmp / f"{name}.duckdb" for name in pmap.names]
    tasks = [(stack_name, spec, n, i, str(parts[i])) for i in range(n)]
    t0 = time.perf_counter()
    results: list[dict] = []
    bar = None
    try:
        if progress:
            bar = Progress(TextColumn(f"[bold]{stack_name}"), BarColumn(), TextColumn("{task.fields[info]}"),
                           TimeElapsedColumn(), transient=True)
            task = bar.add_task("partitions", total=n, info=f"{n} partitions on {jobs} processes")
            bar.start()
        def done(r: dict) -> None:
            results.append(r)
            log.info("partition simulated", partition=pmap.names[r["index"]], done=f"{len(results)}/{n}",
                     wall_s=round(r["wall_s"], 1), events=r["events"], finished=r["finished"],
                     gen_s=round(r["make_s"], 1), peak_rss_mb=r.get("peak_rss_mb") and round(r["peak_rss_mb"]),
                     elapsed_s=round(time.perf_counter() - t0, 1))
            if bar is not None:
                bar.advance(task)

        if jobs == 1:
            for t in tasks:
                done(_worker(t))
        else:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
                for fut in as_completed([pool.submit(_worker, t) for t in tasks]):
                    done(fut.result())
        results.sort(key=lambda r: r["index"])
        t_merge = time.perf_counter()
        prof = run_profile(spec)
        stack = get_stack(stack_name, start=spec.start)
        config = {"driver": "simulator", "stack": stack.describe(), "profile": prof.name,
                  "kv_gpu_tokens": prof.l1_capacity_tokens, "kv_host_tokens": prof.l2_capacity_tokens,
                  "nodes": cfg.nodes, "seed": cfg.seed, "warmup_s": cfg.warmup_s, "duration_s": cfg.duration_s,
                  "agents": cfg.agents, "arrivals_per_min": cfg.arrivals_per_min,
                  "partitions": {name: [ns[0], ns[-1], len(ns)] for name, ns in zip(pmap.names, pmap.nodes,
                                                                                    strict=True)},
                  "merge_order": MERGE_ORDER, "log_level": spec.log_level or "full",
                  **stack.core_config(prof, cfg)}
        with ThreadPoolExecutor(1, thread_name_prefix="merge") as merger:  # the merge beside the figures
            merging = merger.submit(merge_logs, parts, final, config)
            try:
                m = compute_metrics(merged_events(parts, METRIC_TYPES), cfg.warmup_s, cfg.end_s, stack.name)
                m.partitions = partition_figures(parts, pmap, cfg.warmup_s, cfg.end_s)
            finally:
                events = merging.result()
        log.info("partition logs merged, figures folded", events=events,
                 merge_and_figures_s=round(time.perf_counter() - t_merge, 1))
        wall = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the partitions' logs (and a merged log nobody asked for)
    m.unfinished = sum(r["unfinished"] for r in results)
    res = PartitionedResult(stack=stack.name, config=cfg, submitted=sum(r["submitted"] for r in results),
                            finished=sum(r["finished"] for r in results), events=events, wall_s=wall,
                            parts=results, out=out)
    return m, res


def bench_rows(spec: SimSpec, nodes: int, partitions: int, agents_per_node: float, jobs: int | None = None,
               baseline: bool = True) -> list[dict]:
    """``evolving bench sim --partitions N``: the CC-like workload on ``nodes`` nodes (``agents_per_node``
    agents each, the bench's ``--warmup``/``--duration``/``--seed``), simulated as one partition (the
    baseline: one process) and as ``partitions`` partitions on ``jobs`` processes, both end to end
    through :func:`run_partitioned` (spawning, generating sessions, simulating, recording each
    partition's DuckDB log, merging, computing the figures), the evolving stack; ``baseline=False``
    skips the one-partition row. ``cpu_s`` counts this
    process and its finished children; ``peak_rss_mb`` is the largest partition process's peak
    (``VmHWM``; for one partition: this process, which also ran the bench's earlier rows)."""
    rows: list[dict] = []
    for n in ((1,) if baseline else ()) + ((partitions,) if partitions > 1 else ()):
        a = replace(spec, nodes=nodes, agents=max(1, round(agents_per_node * nodes)), partitions=n, jobs=jobs,
                    workload="cc", trace=None, arrivals=None, fast=False)
        c0 = os.times()
        _, res = run_partitioned("evolving", a, None, progress=False)
        c1 = os.times()
        cpu = sum(getattr(c1, f) - getattr(c0, f) for f in ("user", "system", "children_user", "children_system"))
        rss = [p["peak_rss_mb"] for p in res.parts if p.get("peak_rss_mb") is not None]
        used = max(1, min(n, int(jobs or default_jobs())))
        rows.append({"nodes": nodes, "agents": a.agents, "run": f"evolving, {n} partition{'s' if n > 1 else ''}"
                     + (f" ({used} processes)" if n > 1 else ""), "partitions": n, "processes": used,
                     "simulated_s": res.config.end_s, "wall_s": res.wall_s,
                     "x_real_time": res.config.end_s / max(1e-9, res.wall_s), "events": res.events,
                     "events_per_s": res.events / max(1e-9, res.wall_s), "finished": res.finished,
                     "gen_s": sum(p["make_s"] for p in res.parts), "cpu_s": cpu,
                     "peak_rss_mb": max(rss) if rss else None})
    return rows
