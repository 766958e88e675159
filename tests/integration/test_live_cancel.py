"""End to end: ``evolving up`` (its default sim engine, services, recorder and
gateway as child processes) on the session's nats-server. A streaming client that disconnects
after its first tokens: the gateway logs one ``request_cancelled`` line and no traceback, the
recorded log holds its ``RequestCancelled`` and the engine's ``RequestFinished(error="cancelled")``
within a second of it and no decode iteration after, and ``evolving verify`` reproduces every
recorded decision of the run."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from services.adapters.eventlog import DuckDbEventLog
from services.drivers.up.testing import run_cli, stop_up, wait_ready_file

REPO = Path(__file__).resolve().parents[2]
MISSING = [m for m in ("engine.worker", "services.drivers.gateway.app") if importlib.util.find_spec(m) is None]


def _stream_then_leave(url: str, chunks: int = 3) -> str:
    """POST a long streaming chat request, read its first ``chunks`` SSE events, close the
    connection mid-stream; the request's id."""
    u = urllib.parse.urlparse(url)
    body = json.dumps({"messages": [{"role": "user", "content": "y" * 300}], "max_tokens": 60_000,
                       "stream": True, "ignore_eos": True}).encode()  # long: the sim would end its turn
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"x-branch-id: leaver\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(head + body)
        got = b""
        while got.count(b"data: ") < chunks:
            data = sock.recv(65536)
            assert data, got
            got += data
    headers = got.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    assert headers[0].startswith("HTTP/1.1 200"), headers
    return next(h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("x-request-id:"))


@pytest.mark.skipif(bool(MISSING), reason=f"needs the engine worker and gateway: missing {MISSING}")
@pytest.mark.stack
def test_a_client_that_leaves_stops_its_engine_and_the_log_verifies(nats_url, partition, tmp_path):
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "1", "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = wait_ready_file(ready, up, 120)
        rid = _stream_then_leave(urls["gateway"])
        time.sleep(3.0)  # the cancel, the engine's end, the recorder's flush
    finally:
        stop_up(up, 90)
    gw_log = (run_dir / "logs" / "gateway.log").read_text()
    assert "Traceback" not in gw_log and gw_log.count("request_cancelled") == 1, gw_log[-3000:]
    with DuckDbEventLog(run_dir / "run.duckdb", read_only=True) as log:
        rows = log.con.execute(
            "SELECT seq, type, ts, payload->>'$.node', payload->>'$.error', payload->>'$.reason', "
            "payload->>'$.phase' FROM events WHERE payload->>'$.request' = ? OR type = 'IterationDone' "
            "ORDER BY seq", [rid]).fetchall()
    cancels = [r for r in rows if r[1] == "RequestCancelled"]
    fins = [r for r in rows if r[1] == "RequestFinished"]
    assert len(cancels) == 1 and cancels[0][5] == "client_disconnected", rows
    assert len(fins) == 1 and fins[0][4] == "cancelled", rows
    assert fins[0][2] - cancels[0][2] <= 1.0  # the engine stopped decoding within a second
    assert not [r for r in rows if r[1] == "IterationDone" and r[0] > fins[0][0]]  # and stayed idle
    verify = run_cli("verify", str(run_dir / "run.duckdb"), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads(verify.stdout)["ok"]
