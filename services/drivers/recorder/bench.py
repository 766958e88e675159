"""``evolving bench recorder``: events/s appended to DuckDB, side by side with raw baselines.

The mix is a realistic slice of a run: per request a RequestSubmitted with ~1,000 block hashes,
a RouteDecided with scores and a fetch plan, start/first-token/finish facts, KV stores, engine
iterations; plus heartbeats, ticks and planner decisions. Every path writes the same columns
into the same table layout in a fresh file:

- ``eventlog``: :class:`DuckDbEventLog.append` (format 3: Arrow tables, block hashes stored once),
  batches of 4096;
- ``eventlog_v1``: the same with ``format="1"`` (the whole event as JSON, NumPy column arrays:
  the path before format 2);
- ``ndjson``: the same rows as NDJSON written with the standard ``json`` module, loaded by
  ``read_json`` (DuckDB's own bulk JSON path), batches of 4096;
- ``executemany``: ``executemany`` of parameter tuples on a small sample (it is ~1,000x slower).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from typing import Any

import duckdb
import msgspec

from events.catalog import (
    Event,
    FetchStep,
    FirstToken,
    IterationDone,
    KvStored,
    ModelFitted,
    NodeHeartbeat,
    NodeScore,
    PlanEvaluated,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
    Split,
    Tick,
)
from events.subjects import subject_for
from services.adapters.eventlog import DuckDbEventLog, batched
from services.adapters.eventlog.columnar import FORMAT
from services.adapters.eventlog.duckdb_log import SCHEMA

BATCH = 4096


def workload(n_requests: int, seed: int = 7, blocks_per_request: int = 1000) -> list[tuple[int, str, Event]]:
    """A deterministic event mix (seeded); ~12 events per request."""
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(8)]
    events: list[Event] = []
    ts = 0.0
    for i in range(n_requests):
        ts += 0.01
        req, branch = f"r{i}", f"b{i % 50}"
        blocks = [rng.getrandbits(64) for _ in range(blocks_per_request)]
        p, d = rng.choice(nodes[:4]), rng.choice(nodes[4:])
        events += [
            RequestSubmitted(ts=ts, src="gw", request=req, branch=branch, blocks=blocks,
                             prompt_tokens=64 * blocks_per_request + 17, max_tokens=300),
            RouteDecided(ts=ts, src="router", request=req, prefill_node=p, decode_node=d, t_c=48000,
                         t_uc=16017, predicted_ttft_s=0.8, policy="evolving", branch=branch,
                         fetch_plan=[FetchStep(src_node=nodes[5], first_block=600, n_blocks=150)],
                         scores=[NodeScore(node=n, score=rng.random(), t_c=rng.randrange(64000))
                                 for n in nodes[:4]]),
            RequestStarted(ts=ts + 0.1, src=p, request=req, node=p, phase="prefill"),
            KvStored(ts=ts + 0.5, src=p, node=p, tier="L1", blocks=blocks[-250:], request=req),
            FirstToken(ts=ts + 0.8, src=p, request=req, node=p),
            RequestStarted(ts=ts + 0.9, src=d, request=req, node=d, phase="decode"),
            RequestFinished(ts=ts + 4.0, src=d, request=req, node=d, output_tokens=300),
        ]
        events += [IterationDone(ts=ts + 0.01 * k, src=p, node=p, phase="prefill", duration_s=0.05,
                                 batch=4, sum_t_uc=16017, sum_A=2.1e8) for k in range(4)]
        events.append(NodeHeartbeat(ts=ts, src=d, node=d, role="decode", running=40, queued=3))
        if i % 100 == 99:
            events += [Tick(ts=ts, src="planner"),
                       ModelFitted(ts=ts, src="planner", node=p, phase="prefill",
                                   coefficients=[1e-3, 2e-5, 3e-10, 1e-6], samples=500, mape=0.03),
                       PlanEvaluated(ts=ts, src="planner", window_start=ts - 1, window_end=ts,
                                     current=Split(prefill=4, decode=4), chosen=None, reason="no gain")]
    return [(i + 1, subject_for(e), e) for i, e in enumerate(events)]


def _row_tuple(seq: int, subject: str, ev: Event) -> tuple:
    return (seq, ev.ts, type(ev).__name__, ev.src, subject, json.dumps(msgspec.to_builtins(ev)))


def _bench_eventlog(rows, path: str, fmt: str = FORMAT) -> float:
    log = DuckDbEventLog(path, format=fmt)
    t0 = time.perf_counter()
    for chunk in batched(rows, BATCH):
        log.append(chunk)
    dt = time.perf_counter() - t0
    log.close()
    return dt


def _bench_ndjson(rows, path: str, tmpdir: str) -> float:
    con = duckdb.connect(path)
    con.execute(SCHEMA)
    fn = os.path.join(tmpdir, "batch.ndjson")
    cols = "{seq:'UBIGINT',ts:'DOUBLE',type:'VARCHAR',src:'VARCHAR',subject:'VARCHAR',payload:'JSON'}"
    t0 = time.perf_counter()
    for chunk in batched(rows, BATCH):
        with open(fn, "w") as f:
            f.writelines(json.dumps({"seq": seq, "ts": ev.ts, "type": type(ev).__name__, "src": ev.src,
                                    "subject": subject, "payload": msgspec.to_builtins(ev)}) + "\n" for seq, subject, ev in chunk)
        con.execute(f"INSERT INTO events SELECT * FROM read_json('{fn}', format='newline_delimited', "
                    f"columns={cols}, maximum_object_size=67108864)")
    dt = time.perf_counter() - t0
    con.close()
    return dt


def _bench_executemany(rows, path: str) -> float:
    con = duckdb.connect(path)
    con.execute(SCHEMA)
    params = [_row_tuple(*r) for r in rows]
    t0 = time.perf_counter()
    con.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", params)
    dt = time.perf_counter() - t0
    con.close()
    return dt


def _file_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in (path, path + ".wal") if os.path.exists(f))


def run(n_requests: int = 2000, sample: int = 300, blocks_per_request: int = 1000) -> dict[str, Any]:
    rows = workload(n_requests, blocks_per_request=blocks_per_request)
    payload_mb = sum(len(msgspec.json.encode(r[2])) for r in rows) / 1e6
    with tempfile.TemporaryDirectory(prefix="ei-bench-rec-") as tmp:
        t_log = _bench_eventlog(rows, os.path.join(tmp, "log.duckdb"))
        t_v1 = _bench_eventlog(rows, os.path.join(tmp, "v1.duckdb"), "1")
        bytes_v2, bytes_v1 = (_file_bytes(os.path.join(tmp, f)) for f in ("log.duckdb", "v1.duckdb"))
        t_nd = _bench_ndjson(rows, os.path.join(tmp, "nd.duckdb"), tmp)
        small = rows[:sample]
        t_em = _bench_executemany(small, os.path.join(tmp, "em.duckdb"))
        log = DuckDbEventLog(os.path.join(tmp, "log.duckdb"), read_only=True)
        t0 = time.perf_counter()
        n_read = sum(1 for _ in log.read())
        t_read = time.perf_counter() - t0
        log.close()
    n = len(rows)
    ours = n / t_log
    return {
        "events": n,
        "payload_mb": round(payload_mb, 1),
        "batch": BATCH,
        "eventlog_events_per_s": round(ours),
        "eventlog_mb_per_s": round(payload_mb / t_log, 1),
        "eventlog_bytes": bytes_v2,
        "eventlog_v1_events_per_s": round(n / t_v1),
        "eventlog_v1_bytes": bytes_v1,
        "ratio_vs_v1": round(ours / (n / t_v1), 2),
        "ndjson_read_json_events_per_s": round(n / t_nd),
        "executemany_events_per_s": round(sample / t_em),
        "executemany_sample": sample,
        "ratio_vs_ndjson": round(ours / (n / t_nd), 2),
        "ratio_vs_executemany": round(ours / (sample / t_em), 1),
        "read_decode_events_per_s": round(n_read / t_read),
    }
