"""The recorder's memory without a stack: a recorded stream appended again, RSS per row.

``python -m services.drivers.recorder.rss RUN.duckdb [--rows 300000] [--batch 46] [--json]``

A soak's recorder grows or not with what it appends; this isolates it. The events of a recorded
log (a soak's ``run.duckdb``) are appended again to a fresh log opened the way the recorder opens
its own (``memory_limit``, hence the streaming checkpoint threshold and the bounded block
dictionary), in batches of ``--batch`` rows from a worker thread as ``run_recorder`` does, with
its heap trim (``--trim-every-rows``: the recorder's every 10 s at the soak's rate) (the
soak's 20 req/s made ~230 events/s, 46 rows per 0.2 s flush). The source is cycled until
``--rows``; each cycle XORs every block hash with a constant of its own, so its hashes are new
(as a live run's keep coming) while their reuse within the cycle is the recorded one.

Every ``--sample-rows`` rows it reads its anonymous RSS (``/proc/self/status``), the block
dictionary's size and DuckDB's own buffer accounting (``duckdb_memory()``), and reports the
Theil-Sen slope of the anonymous RSS over the second half, in MB per 100,000 rows and in MB per
minute at ``--events-per-s`` (the soak's rate). No pacing: the per-row slope is what a paced run
shows, faster (time-driven effects, DuckDB's checkpoints by WAL size included, follow rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

import msgspec
import numpy as np

from services.adapters.eventlog import DuckDbEventLog
from services.adapters.eventlog.duckdb_log import STREAM_BLOCK_DICT_ENTRIES
from services.drivers.recorder.service import release_free_heap


def anon_rss_mb() -> float:
    """This process's anonymous RSS (``RssAnon``), MB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cycled(events: list, cycle: int) -> list:
    """``events`` of cycle ``cycle``: every block hash XORed with a constant of the cycle (made
    per batch: a copy of the whole source per cycle would be a step in the RSS it measures)."""
    if cycle == 0:
        return events
    salt = (0x9E3779B97F4A7C15 * cycle) & 0xFFFFFFFFFFFFFFFF
    replace = msgspec.structs.replace
    return [replace(e, blocks=[h ^ salt for h in e.blocks]) if getattr(e, "blocks", None) else e
            for e in events]


def _append(log, chunk, trim: bool) -> None:
    log.append(chunk)
    if trim:
        release_free_heap()


def run(source: str, rows: int = 300_000, batch: int = 46, sample_rows: int = 5_000,
        memory_limit: str = "512MB", block_dict_entries: int | None = None,
        events_per_s: float = 230.0, out: str | None = None, trim_every_rows: int | None = 2_300) -> dict[str, Any]:
    from scipy.stats import theilslopes  # lazy: the slope only

    src = DuckDbEventLog(source, read_only=True)
    recorded = [(subj, ev) for _, subj, ev in src.read()]
    src.close()
    if not recorded:
        raise SystemExit(f"error: {source} holds no events")
    subjects = [s for s, _ in recorded]
    events = [e for _, e in recorded]
    del recorded
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="ei-rss-")
        out = os.path.join(tmp.name, "rss.duckdb")
    log = DuckDbEventLog(out, memory_limit=memory_limit, block_dict_entries=block_dict_entries)
    samples: list[dict[str, Any]] = []

    def sample(n: int) -> None:
        mem = dict(log.con.execute("SELECT tag, memory_usage_bytes FROM duckdb_memory()").fetchall())
        bd = log._blocks
        samples.append({"rows": n, "anon_mb": round(anon_rss_mb(), 2),
                        "duckdb_mb": round(sum(mem.values()) / 2**20, 2),
                        "dict_entries": bd.entries if bd is not None else 0,
                        "dict_mb": round(bd.nbytes / 2**20, 2) if bd is not None else 0.0})

    async def go() -> None:
        seq, cycle, next_sample = 0, 0, 0
        while seq < rows:
            for k in range(0, len(events), batch):
                part = _cycled(events[k:k + batch], cycle)
                chunk = [(seq + 1 + i, subjects[k + i], e) for i, e in enumerate(part)]
                trim = trim_every_rows is not None and (seq + len(chunk)) // trim_every_rows > seq // trim_every_rows
                await asyncio.to_thread(_append, log, chunk, trim)
                seq += len(chunk)
                if seq >= next_sample:
                    sample(seq)
                    next_sample += sample_rows
                if seq >= rows:
                    break
            cycle += 1

    t0 = time.perf_counter()
    try:
        asyncio.run(go())
        sample(log.last_seq())
    finally:
        log.close()
        if tmp is not None:
            tmp.cleanup()
    wall = time.perf_counter() - t0
    half = [s for s in samples if s["rows"] >= samples[-1]["rows"] / 2]
    x = np.array([s["rows"] for s in half], dtype=float)
    y = np.array([s["anon_mb"] for s in half], dtype=float)
    per_row = float(theilslopes(y, x).slope) if len(half) >= 3 else float("nan")
    return {"source": source, "source_events": len(events), "rows": samples[-1]["rows"], "batch": batch,
            "memory_limit": memory_limit, "trim_every_rows": trim_every_rows,
            "block_dict_entries": block_dict_entries if block_dict_entries is not None else STREAM_BLOCK_DICT_ENTRIES,
            "wall_s": round(wall, 1), "anon_mb_first": samples[0]["anon_mb"], "anon_mb_last": samples[-1]["anon_mb"],
            "slope_mb_per_100k_rows": round(per_row * 1e5, 3),
            "slope_mb_per_min_at_rate": round(per_row * events_per_s * 60, 3), "events_per_s": events_per_s,
            "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.drivers.recorder.rss", description=__doc__.split("\n")[0])
    p.add_argument("source", help="a recorded event log (e.g. a soak's run.duckdb)")
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--batch", type=int, default=46)
    p.add_argument("--sample-rows", type=int, default=5_000)
    p.add_argument("--memory-limit", default="512MB")
    p.add_argument("--block-dict-entries", type=int, default=None,
                   help=f"per generation (default {STREAM_BLOCK_DICT_ENTRIES:,}; 0: unbounded, the format before)")
    p.add_argument("--events-per-s", type=float, default=230.0, help="the rate the per-minute slope is given at")
    p.add_argument("--trim-every-rows", type=int, default=2_300,
                   help="release_free_heap() after every this many rows (2,300: the recorder's 10 s at 230 "
                        "events/s; 0: never)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = run(a.source, a.rows, a.batch, a.sample_rows, a.memory_limit, a.block_dict_entries, a.events_per_s,
            trim_every_rows=a.trim_every_rows or None)
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    for s in r["samples"]:
        print(f"{s['rows']:>9,} rows  anon {s['anon_mb']:8.2f} MB  duckdb {s['duckdb_mb']:7.2f} MB  "
              f"dict {s['dict_entries']:>9,} entries {s['dict_mb']:6.2f} MB")
    print(f"slope over the second half: {r['slope_mb_per_100k_rows']} MB per 100k rows = "
          f"{r['slope_mb_per_min_at_rate']} MB/min at {r['events_per_s']:.0f} events/s ({r['wall_s']} s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
