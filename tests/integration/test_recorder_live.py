"""`evolving sql --live` against a real recorder service (``python -m services.drivers.serve recorder``, a
child process holding the DuckDB file) and a real nats-server: the file is locked, the recorder
answers with a consistent snapshot, the answer follows the run, and when the recorder stops its
files go away and the run is read directly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.adapters.bus import NatsBus
from services.drivers.recorder.bench import workload
from services.drivers.recorder.live import sidecar_path, snapshot_path
from services.drivers.up.testing import spawn_service, wait_until

pytestmark = pytest.mark.asyncio


def sql(*argv: str) -> tuple[int, str, str]:
    """``evolving sql`` in a child process (as a user runs it; it may block on NATS)."""
    r = subprocess.run([sys.executable, "-m", "services.drivers.cli", "sql", *argv], capture_output=True, text=True,
                       check=False, timeout=120, env={**os.environ, "EI_NATS_URL": "nats://127.0.0.1:1"})
    return r.returncode, r.stdout, r.stderr


async def asql(*argv: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(sql, *argv)


async def test_sql_live_queries_a_running_recorder(nats_url, partition, tmp_path):
    db = tmp_path / "run.duckdb"
    events = [e for _, _, e in workload(30, blocks_per_request=20)]
    half = len(events) // 2
    proc = spawn_service("recorder", nats_url, partition, "--db", str(db), "--flush-interval-s", "0.05",
                         log_path=tmp_path / "recorder.log")
    bus = await NatsBus.connect(nats_url, partition)
    try:
        await wait_until(lambda: _exists(sidecar_path(db)), 60, what="the recorder's live.json")
        side = json.loads(Path(sidecar_path(db)).read_text())
        assert side["partition"] == partition and side["pid"] == proc.pid and side["nats_url"] == nats_url

        seqs = await bus.publish_many(events[:half])
        rc, out, err = await asql(str(db), "SELECT count(*) AS n FROM events")
        assert rc == 2 and "--live" in err and "held by a running writer" in err  # the lock, explained

        async def recorded(n: int) -> bool:
            rc, out, err = await asql(str(db), "--live", "--json", "SELECT count(*) AS n, max(seq) AS top FROM events")
            assert rc == 0, err
            got = json.loads(out)
            # the snapshot is consistent: it holds exactly the rows up to the seq it reports
            assert f"up to seq {got['top'] or 0} " in err, err
            return got["n"] == n

        await wait_until(lambda: recorded(half), 60, every_s=0.3, what=f"{half} events through --live")
        assert seqs[-1] == half

        seqs += await bus.publish_many(events[half:])
        await wait_until(lambda: recorded(len(events)), 60, every_s=0.3, what="every event through --live")
        rc, out, err = await asql(str(db), "--live", "--format", "csv",
                                  "SELECT count(*) AS n FROM requests WHERE ttft_s IS NOT NULL")
        assert rc == 0 and out.splitlines() == ["n", "30"], err
        rc, out, err = await asql(str(db), "--live", f"COPY events TO '{tmp_path}/leak.csv'")
        assert rc == 2 and "COPY" in err and not (tmp_path / "leak.csv").exists()  # the snapshot is sandboxed too
        assert os.path.exists(snapshot_path(db))
    finally:
        await bus.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc_rec = await asyncio.to_thread(proc.wait, 60)
    assert rc_rec == 0
    assert not os.path.exists(sidecar_path(db)) and not os.path.exists(snapshot_path(db))  # cleaned up
    rc, out, err = await asql(str(db), "--live", "--json", "SELECT count(*) AS n FROM events")
    assert rc == 0 and json.loads(out) == {"n": len(events)} and "snapshot" not in err  # read directly


async def test_sql_live_with_no_recorder_answering_says_so(nats_url, partition, tmp_path):
    """A file held by some writer, a live.json naming a partition where no recorder listens."""
    db = tmp_path / "run.duckdb"
    from services.adapters.eventlog import DuckDbEventLog

    DuckDbEventLog(db).close()
    Path(sidecar_path(db)).write_text(json.dumps({"nats_url": nats_url, "partition": partition}))
    hold = "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(db)],  # noqa: ASYNC220 - a child holding the file
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, _out, err = await asql(str(db), "--live", "--timeout-s", "3", "SELECT 1")
        assert rc == 2 and "no recorder answers" in err and partition in err and err.count("\n") == 1, err
        t0 = time.monotonic()
        rc, _out, err = await asql(str(db), "--live", "--nats-url", "nats://127.0.0.1:9", "SELECT 1")
        assert rc == 2 and "cannot reach the bus at nats://127.0.0.1:9" in err and err.count("\n") == 1, err
        assert "ConnectionRefusedError" in err and time.monotonic() - t0 < 20  # refused: no wait for --timeout-s (30)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


async def _exists(path) -> bool:
    return os.path.exists(path)
