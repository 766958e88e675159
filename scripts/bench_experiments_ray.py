"""The same rows of ``evolving experiments`` run by local processes and by a Ray cluster, side by side.

    .venv/bin/python scripts/bench_experiments_ray.py [--json] [-- EXPERIMENTS FLAGS]
    (default flags: --quick --only cc-126; e.g. -- --tiny to try it in seconds)

First the baseline, ``--jobs 2`` (local processes, the default runner), then ``--ray ADDRESS`` on a
Ray cluster this script starts on this machine (services/adapters/ray_head.py, the ray suite's
head too: ``ray start --head --block``, 2 CPUs, a 200 MB object store, in a temporary folder;
stopped by its own process id at the end) or, with
``--address``, on yours. Per runner: wall time of the whole command (the Ray connection
included), CPU of the rows (summed in the processes that ran them) and of everything the runner
used (this process, the pool's workers, and, when this script started the cluster, its daemons
and workers; sampled from /proc), the ratio of Ray's
wall to the baseline's, and whether every row's event log has the same digest. Load average
before and after. Both runs use this machine's 2 cores, so the figures show the overhead of
going through Ray, not the spread's gain (the rows are independent: on N machines they run N x
CPUs at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay.experiments.run import log_digest  # after the path: the script runs from anywhere
from services.adapters.ray_head import local_ray_head, process_tree
from services.drivers.cli import main

TICK = os.sysconf("SC_CLK_TCK")


class TreeCpu:
    """CPU seconds of a process tree over a run, its processes sampled every 0.2 s (a process
    that ends between two samples loses at most its last 0.2 s): the sum of each process's last
    utime + stime seen, less what it had at the start."""

    def __init__(self, root: int) -> None:
        self.root, self.seen, self.start = root, {}, {}
        self._stop = threading.Event()
        self._sample(self.start)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self, into: dict) -> None:
        for pid, st in process_tree(self.root).items():
            into[(pid, st[19])] = (int(st[11]) + int(st[12])) / TICK

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._sample(self.seen)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self._sample(self.seen)
        return sum(v - self.start.get(k, 0.0) for k, v in self.seen.items())


def run(flags: list[str], out: Path, runner: list[str], cluster_pid: int | None) -> dict:
    load0 = os.getloadavg()[0]
    here = TreeCpu(os.getpid())  # this process and the pool's workers
    there = TreeCpu(cluster_pid) if cluster_pid else None  # the cluster's daemons and workers
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as sink, redirect_stdout(sink):  # the tables: in the file
        rc = main(["experiments", *flags, "--no-progress", "--out-dir", str(out), *runner])
    wall = time.perf_counter() - t0
    total = here.stop() + (there.stop() if there else 0.0)
    summary = json.loads((out / "summary.json").read_text())
    rows = [r for e in summary["experiments"] for r in e["runs"] if not r["same_as"]]
    rows_cpu = sum(r["cpu_s"] for r in rows)
    return {"runner": " ".join(runner), "rc": rc, "rows": len(rows), "wall_s": round(wall, 1),
            "total_cpu_s": round(total, 1), "rows_cpu_s": round(rows_cpu, 1),
            "other_cpu_s": round(total - rows_cpu, 1),  # start-up, the driver, Ray's daemons
            "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "digests": {f"{r['label']}": log_digest(r["log"])[1] for r in rows if r["status"] == "ok"},
            "status": sorted({r["status"] for r in rows})}


def cmd() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default="", help="a running Ray cluster (default: one started here)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("flags", nargs="*", help="evolving experiments flags, after --")
    a = ap.parse_args()
    flags = a.flags or ["--quick", "--only", "cc-126"]
    tmp = Path(tempfile.mkdtemp(prefix="ei-bench-ray-", dir="/tmp"))
    try:
        base = run(flags, tmp / "local", ["--jobs", "2"], None)
        if a.address:
            ray = run(flags, tmp / "ray", ["--ray", a.address], None)
        else:
            with local_ray_head(tmp) as (address, pid):
                ray = run(flags, tmp / "ray", ["--ray", address], pid)
                ray["runner"] = "--ray <a local cluster started here, 2 CPUs>"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {"flags": flags, "cores": os.cpu_count(), "baseline": base, "ray": ray,
           "ray_wall_over_baseline": round(ray["wall_s"] / base["wall_s"], 2),
           "same_logs_as_baseline": ray["digests"] == base["digests"] and len(base["digests"]) == base["rows"]}
    for d in (base, ray):
        print(f"{d['runner']:48s} rc {d['rc']}  {d['rows']} rows  wall {d['wall_s']:7.1f} s  rows CPU "
              f"{d['rows_cpu_s']:7.1f} s  all CPU {d['total_cpu_s']:7.1f} s (other {d['other_cpu_s']:.1f} s)"
              f"  load {d['load_1m'][0]:.1f}->{d['load_1m'][1]:.1f}")
    print(f"Ray / local processes, wall: {doc['ray_wall_over_baseline']:.2f}x; "
          f"same event logs: {doc['same_logs_as_baseline']}")
    if a.json:
        print(json.dumps(doc, indent=2))
    return 0 if doc["same_logs_as_baseline"] and base["rc"] == ray["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(cmd())
