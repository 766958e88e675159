"""Real KV bytes end to end: ``evolving up --kv-bytes`` (sim engines with real bytes, Mooncake
over TCP between the worker processes) serves a bundled trace (the three weka Claude Code
sessions, cut to their first requests and short outputs so the run stays short) and every block
the log says was moved (``KvMoved``, prefill -> decode) or fetched (``KvFetched``, from a
peer's host memory) arrived as bytes whose checksum was verified; ``evolving verify`` still
reproduces every decision (bytes never change one).

Two prefill engines and one decode engine; the router is told that a fetched block's duplicate
copy is a gain rather than a cost (``dup_cost_s_per_token`` < 0), so a session's next request
goes to the prefill node that does *not* hold its history and fetches it from the one that
does: both paths (P->D writes and peer-fetch reads) run on every run, whatever the timing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from services.adapters.eventlog import DuckDbEventLog
from services.drivers.up.testing import run_cli, stop_up

pytestmark = pytest.mark.torch  # its own suite after the default one (pyproject.toml, scripts/test.sh)

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "fixtures" / "traces" / "weka-claude-code"
BLOCK_BYTES = 256
REQUESTS_PER_BRANCH = 5
MAX_OUTPUT = 48


def _why_skip() -> str:
    for mod in ("torch", "engine.worker", "services.drivers.gateway.drive"):
        if importlib.util.find_spec(mod) is None:
            return f"missing {mod}"
    from engine.transfer.mooncake import mooncake_available

    ok, why = mooncake_available()
    return "" if ok else f"Mooncake unavailable: {why}"


WHY = _why_skip()
if WHY:
    print(f"test_kvbytes_live skipped: {WHY}", file=sys.stderr)


def _small_trace(src: Path, dst: Path) -> int:
    """The first requests of every branch, outputs capped: a short run with the same reuse."""
    n = 0
    with src.open() as fin, dst.open("w") as fout:
        for line in fin:
            session = json.loads(line)
            for branch in session["branches"]:
                steps, seen = [], 0
                for step in branch["steps"]:
                    if step["kind"] == "request":
                        seen += 1
                        if seen > REQUESTS_PER_BRANCH:
                            continue
                        step["output_tokens"] = min(step["output_tokens"], MAX_OUTPUT)
                        n += 1
                    steps.append(step)
                branch["steps"] = steps
            fout.write(json.dumps(session) + "\n")
    return n


def _summaries(logs: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(logs.glob("engine-n*.log")):
        for line in path.read_text().splitlines():
            if "kv_bytes_summary" in line:
                rec = json.loads(line[line.index("{"):])
                out[rec["node"]] = rec
    return out


@pytest.mark.skipif(bool(WHY), reason=WHY or "-")
def test_live_run_with_kv_bytes_verifies_every_moved_and_fetched_block(nats_url, partition, tmp_path):
    full, trace = tmp_path / "full.jsonl", tmp_path / "trace.jsonl"
    imported = run_cli("trace", "import", "weka", str(TRACES), "-o", str(full))
    assert imported.returncode == 0, imported.stderr
    requests = _small_trace(full, trace)
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    db = run_dir / "run.duckdb"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "3", "--prefill", "2", "--kv-bytes",
         "--kv-block-bytes", str(BLOCK_BYTES), "--router-arg", "dup_cost_s_per_token=-0.001",
         "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert up.poll() is None, f"evolving up exited early with {up.returncode}: {up.stdout.read()}"
            assert time.monotonic() < deadline, "evolving up not ready within 90 s"
            time.sleep(0.2)
        urls = json.loads(ready.read_text())
        # `ready` means every process answers; the engines (torch + Mooncake to load) may still
        # be registering: a request before that waits for a prefill node
        for i in range(3):
            log_file = run_dir / "logs" / f"engine-n{i}.log"
            while not (log_file.exists() and "worker_up" in log_file.read_text()):
                assert time.monotonic() < deadline + 60, f"{log_file.name}: no worker_up"
                time.sleep(0.2)
        drive = run_cli("drive", str(trace), "--gateway", urls["gateway"], "--speedup", "10000", "--concurrency", "3",
                     "--json", "--timeout-s", "60", "--run-id", "kv-", "--no-progress", timeout=180)
        assert drive.returncode == 0, drive.stdout + drive.stderr
        summary = json.loads(drive.stdout)
        assert summary["requests_failed"] == 0 and summary["requests_ok"] == requests, summary
    finally:
        stop_up(up, 90)

    with DuckDbEventLog(db, read_only=True) as log:
        q = log.con.execute
        moved, fetched = Counter(), Counter()
        for dst, blocks in q("SELECT payload->>'$.dst_node', payload->'$.blocks' FROM events "
                             "WHERE type = 'KvMoved'").fetchall():
            moved[dst] += len(json.loads(blocks))
        for dst, blocks in q("SELECT payload->>'$.dst_node', payload->'$.blocks' FROM events "
                             "WHERE type = 'KvFetched'").fetchall():
            fetched[dst] += len(json.loads(blocks))
        endpoints = {n: e for n, e in q("SELECT payload->>'$.node', payload->>'$.transfer_endpoint' FROM events "
                                        "WHERE type = 'NodeRegistered'").fetchall()}
        routes = log.count_by_type()["RouteDecided"]
    assert set(endpoints) == {"n0", "n1", "n2"}
    assert all(e.startswith("mooncake://127.0.0.1:") and ";ctl=127.0.0.1:" in e for e in endpoints.values()), endpoints

    stats = _summaries(run_dir / "logs")
    assert set(stats) == {"n0", "n1", "n2"}, stats
    assert sum(moved.values()) > 0 and sum(fetched.values()) > 0, (moved, fetched)  # both paths ran
    for node, s in stats.items():
        # every block the log says arrived here arrived as bytes, and its checksum was checked
        assert s["moved_blocks"] == moved[node] and s["fetched_blocks"] == fetched[node], (node, s, moved, fetched)
        assert s["failed"] == 0 and s["unavailable"] == 0 and s["held_slots"] == 0, (node, s)
        assert s["verified"] == s["moved_blocks"] + s["fetched_blocks"] + s["local_copies"], (node, s)
        assert s["bytes_in"] == (s["moved_blocks"] + s["fetched_blocks"]) * BLOCK_BYTES, (node, s)
    assert sum(s["bytes_out"] for s in stats.values()) == sum(s["bytes_in"] for s in stats.values())

    verify = run_cli("verify", str(db), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["ok"] and report["reproduced"].get("RouteDecided") == routes >= requests, report
