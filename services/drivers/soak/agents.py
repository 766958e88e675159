"""``evolving soak --trace``: real agent sessions replayed through the gateway of one ``evolving
up``, several times, while busy loops compete for the CPU.

The load of the issue: 30 real Claude Code sessions (the bundled calibration traces), each cut to
its first 8 requests (``replay.traces.format.cut_session``), 30 at a time, replayed closed-loop by the driver
``evolving drive`` uses (services/drivers/gateway/drive.py) - once per ``repeat``, on the same
stack, each repeat under a run id of its own (its branches never meet the previous repeat's
ended ones). ``busy`` processes ``python -c 'while True: pass'`` run beside the stack from before
the first repeat to after the last.

What it counts (:func:`liveness_figures`, from the recorded log, and the client's outcomes):

* **lost**: requests the client did not get whole (an HTTP error, an error chunk in the stream,
  a timeout); and, from the log, the load's requests that finished with an error;
* **removals**: ``NodeRemoved`` events not published by the node itself (the liveness
  watcher's: ``src="liveness"``; an engine's own ``restarted``/``shutdown`` are not removals);
* **silence**: what the liveness watcher sees - at every ``Tick``, per registered node, the time
  since that node's last event (``tick.ts - last_seen``, the quantity it compares to its
  grace); and the **heartbeat lateness**: for each ``NodeHeartbeat``, how far the newest tick
  folded before it is past its ``ts`` (``max(0, tick.ts - hb.ts)``: a lower bound, at the
  tick's resolution, on the time from the heartbeat's stamp to the stream);
* the engines' own heartbeat figures, from their logs (``heartbeat_stats`` lines,
  engine/worker/publish.py): publish latency (stamp to ack) and the main loop's lag.

Everything but the load itself is read after the stack has stopped, from its log folder and
its DuckDB file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from replay.traces.format import Session, cut_session
from services.drivers.soak.stats import nearest_rank

#: node-initiated removals: the engine said it is going (not a liveness decision)
OWN_REMOVALS = ("restarted", "shutdown")


# --------------------------------------------------------------------------- the sessions
def agent_sessions(spec: str, sessions: int, turns: int, context_tokens: int = 262_144) -> list[Session]:
    """The first ``sessions`` sessions of the workload ``spec`` that, cut to ``turns`` requests,
    fit the gateway's context (prompt + output <= ``context_tokens``, its default 262,144: a
    longer one is a 400 whatever the stack does), each cut so."""
    from replay.traces.importers.spec import load_workload  # lazy: evolving --help (the importers)

    out: list[Session] = []
    for s in load_workload(spec).sessions:
        c = cut_session(s, turns)
        if all(len(r.blocks) * c.block_tokens + r.tail_tokens + max(1, r.output_tokens) <= context_tokens
               for _, _, r in c.requests()):
            out.append(c)
        if len(out) == sessions:
            break
    return out


def request_count(sessions: Iterable[Session]) -> tuple[int, int]:
    """(requests, prompt tokens) of ``sessions``."""
    n = tokens = 0
    for s in sessions:
        for _, _, r in s.requests():
            n += 1
            tokens += len(r.blocks) * s.block_tokens + r.tail_tokens
    return n, tokens


# --------------------------------------------------------------------------- what the log says (pure)
@dataclass
class Silence:
    """The liveness watcher's view of a log, refolded: per node, the silence at each tick and the
    lateness of each heartbeat (see the module docstring)."""

    at_tick: dict[str, list[float]] = field(default_factory=dict)
    hb_late: dict[str, list[float]] = field(default_factory=dict)
    hb_gap: dict[str, list[float]] = field(default_factory=dict)  # ts between consecutive heartbeats


def silences(rows: Iterable[tuple[str, float, str | None, str | None]]) -> Silence:
    """``rows``: (type, ts, node, src) in stream order. A node is watched from its
    ``NodeRegistered`` to its ``NodeRemoved``; any event it publishes about itself refreshes it."""
    out = Silence()
    last: dict[str, float] = {}
    last_hb: dict[str, float] = {}
    tick = None
    for typ, ts, node, src in rows:
        if typ == "Tick":
            tick = ts if tick is None else max(tick, ts)
            for n, seen in last.items():
                out.at_tick.setdefault(n, []).append(max(0.0, ts - seen))
        elif typ == "NodeRegistered" and node:
            last[node] = max(ts, tick or ts, last.get(node, ts))
        elif typ == "NodeRemoved" and node:
            last.pop(node, None)
            last_hb.pop(node, None)
        elif node and src == node and node in last:
            last[node] = max(last[node], ts)
            if typ == "NodeHeartbeat":
                if tick is not None:
                    out.hb_late.setdefault(node, []).append(max(0.0, tick - ts))
                if node in last_hb:
                    out.hb_gap.setdefault(node, []).append(ts - last_hb[node])
                last_hb[node] = ts
    return out


def _pcts(xs: Sequence[float]) -> dict[str, float | None]:
    def r(v):
        return None if v is None else round(v, 3)

    return {"n": len(xs), "p50": r(nearest_rank(xs, 0.5)), "p99": r(nearest_rank(xs, 0.99)),
            "max": r(max(xs) if xs else None)}


def summarize_silence(s: Silence) -> dict[str, Any]:
    every = [x for xs in s.at_tick.values() for x in xs]
    late = [x for xs in s.hb_late.values() for x in xs]
    gaps = [x for xs in s.hb_gap.values() for x in xs]
    return {"silence_at_tick_s": _pcts(every), "heartbeat_late_s": _pcts(late), "heartbeat_gap_s": _pcts(gaps),
            "silence_max_by_node_s": {n: round(max(xs), 3) for n, xs in sorted(s.at_tick.items()) if xs}}


def liveness_figures(db: Path, run_ids: Sequence[str]) -> dict[str, Any]:
    """Removals, errors of the load's requests and the watcher's silences, from the log ``db``."""
    from services.adapters.eventlog import DuckDbEventLog  # lazy: evolving --help (duckdb)

    with DuckDbEventLog(db, read_only=True) as log:
        con = log.con
        rows = con.execute(
            "SELECT type, ts, payload->>'$.node', src FROM events "
            "WHERE type IN ('Tick', 'NodeRegistered', 'NodeRemoved', 'NodeHeartbeat', 'IterationDone', "
            "'RequestStarted', 'FirstToken', 'RequestFinished', 'RoleSwitched', 'KvStored', 'KvEvicted') "
            "ORDER BY seq").fetchall()
        removed = con.execute(
            "SELECT src, payload->>'$.node', payload->>'$.reason' FROM events WHERE type = 'NodeRemoved' "
            "ORDER BY seq").fetchall()
        like = " OR ".join(["payload->>'$.branch' LIKE ?"] * len(run_ids)) or "false"
        errors = con.execute(
            "SELECT payload->>'$.error' FROM events WHERE type = 'RequestFinished' "
            "AND coalesce(payload->>'$.error', '') <> '' AND payload->>'$.request' IN ("
            f"SELECT payload->>'$.request' FROM events WHERE type = 'RequestSubmitted' AND ({like}))",
            [f"{r}%" for r in run_ids]).fetchall()
    removals = [(src, node, reason) for src, node, reason in removed
                if not (src == node and (reason or "") in OWN_REMOVALS)]
    return {"removals": len(removals),
            "removal_reasons": [f"{node}: {reason} ({src})" for src, node, reason in removals][:20],
            "log_errors": len(errors), "log_error_reasons": sorted({e for (e,) in errors})[:5],
            **summarize_silence(silences((t, float(ts), n, s) for t, ts, n, s in rows))}


def engine_heartbeat_stats(logs: Path) -> dict[str, Any]:
    """The engines' ``heartbeat_stats`` lines (engine/worker/publish.py), merged per node and over
    all: heartbeats sent and failed, publish latency (stamp to ack) and main-loop lag, p50 / p99 /
    max of every sample."""
    pub: dict[str, list[float]] = {}
    lag: dict[str, list[float]] = {}
    failed: Counter = Counter()
    for f in sorted(logs.glob("engine-*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if '"heartbeat_stats"' not in line:
                continue
            with contextlib.suppress(ValueError):
                d = json.loads(line)
                node = str(d.get("node"))
                pub.setdefault(node, []).extend(x / 1e3 for x in d.get("publish_ms") or [])
                lag.setdefault(node, []).extend(x / 1e3 for x in d.get("loop_lag_ms") or [])
                failed[node] += int(d.get("failed", 0))

    def row(p: list[float], g: list[float], fails: int) -> dict[str, Any]:
        a, b = _pcts(p), _pcts(g)
        return {"beats": len(g), "failed": fails, "publish_p50_s": a["p50"], "publish_p99_s": a["p99"],
                "publish_max_s": a["max"], "loop_lag_p50_s": b["p50"], "loop_lag_p99_s": b["p99"],
                "loop_lag_max_s": b["max"]}

    nodes = sorted(lag)
    every = row([x for n in nodes for x in pub.get(n, [])], [x for n in nodes for x in lag[n]],
                sum(failed.values())) if nodes else {}
    return {"all": every, "by_node": {n: row(pub.get(n, []), lag[n], failed[n]) for n in nodes}}


# --------------------------------------------------------------------------- the run
@dataclass
class AgentLoadConfig:
    run_dir: Path
    trace: str = "deploy/traces/calibration"
    sessions: int = 30
    turns: int = 8
    concurrency: int = 30
    speedup: float = 1.0  # pauses between a session's requests divided by this
    repeat: int = 2
    busy: int = 2  # busy-loop processes competing for the CPU during the load
    engines: int = 4
    up_args: list[str] = field(default_factory=list)
    timeout_s: float = 300.0  # one HTTP request
    ready_file: Path | None = None  # attach to a running `evolving up` (left running)


class BusyLoops:
    """``n`` processes ``python -c 'while True: pass'``, stopped (by pid) on exit."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Self:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


async def run_agents(cfg: AgentLoadConfig, say=print) -> dict[str, Any]:
    """The whole run; the report (``ok``: 0 lost, 0 errors on the log and 0 removals)."""
    from services.drivers.gateway.drive import DriveConfig, Driver  # lazy: aiohttp
    from services.drivers.soak.live_up import LiveUp  # lazy: nats, duckdb

    sessions = agent_sessions(cfg.trace, cfg.sessions, cfg.turns)
    n_req, n_tok = request_count(sessions)
    say(f"load: {len(sessions)} sessions x {cfg.turns} requests = {n_req} requests, {n_tok / 1e6:.1f} M prompt "
        f"tokens, {cfg.concurrency} at a time, x{cfg.repeat}, {cfg.busy} busy loops")
    stack = LiveUp(run_dir=cfg.run_dir, engines=cfg.engines, up_args=cfg.up_args, ready_file=cfg.ready_file)
    report: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()},
                              "load": {"requests": n_req, "prompt_tokens": n_tok}, "repeats": []}
    tag = f"ag{time.strftime('%H%M%S')}{os.getpid() % 1000:03d}"
    run_ids = [f"{tag}r{i}-" for i in range(cfg.repeat)]
    lost = 0
    try:
        t0 = time.monotonic()
        await stack.start()
        report["stack"] = {"run_dir": str(stack.run_dir), "db": str(stack.db), "start_s": round(time.monotonic() - t0, 1)}
        with BusyLoops(cfg.busy):
            for i, run_id in enumerate(run_ids):
                dcfg = DriveConfig(gateway=stack.gateway, concurrency=cfg.concurrency, speedup=cfg.speedup,
                                   timeout_s=cfg.timeout_s, run_id=run_id, wait_s=30.0)
                rep = await Driver(dcfg).run(sessions)
                s = rep.summary()
                failed = [r for r in rep.results if r.status != 200 or r.error]
                lost += len(failed)
                row = {"repeat": i + 1, "requests_ok": s["requests_ok"], "failed": len(failed),
                       "wall_s": s["wall_s"], "ttft_p50_s": s["ttft_p50_s"], "ttft_p95_s": s["ttft_p95_s"],
                       "latency_p95_s": s["latency_p95_s"], "errors": sorted({r.error[:200] for r in failed})[:5]}
                report["repeats"].append(row)
                say(f"repeat {i + 1}: {row['requests_ok']} ok, {row['failed']} failed in {row['wall_s']:.0f} s")
        await asyncio.sleep(1.0)  # the last RequestFinished may follow its `done` token by a moment
        if not stack.attached:
            report["stack"]["up_rc"] = await stack.stop()
            db = stack.db
        else:
            db = await stack.log_for_check((await stack.stream_state()).head)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(stack.kill)
    figs = await asyncio.to_thread(liveness_figures, db, run_ids)
    report["liveness"] = figs
    report["engines"] = engine_heartbeat_stats(Path(stack.ready.get("logs") or stack.run_dir / "logs"))
    report["lost"] = lost  # requests the client did not get whole
    report["removals"] = figs["removals"]
    report["ok"] = lost == 0 and figs["log_errors"] == 0 and figs["removals"] == 0
    return report
