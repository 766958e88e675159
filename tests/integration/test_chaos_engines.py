"""``evolving chaos --engines --quick`` in CI: the engine faults' short form
with a real sim engine worker per node - a worker SIGSTOPped until the planner removes it (it
registers again), a worker SIGKILLed mid-prefill and one mid-decode (their requests re-routed
or failed with a clear error, the directory forgets their KV), a KV transfer cut mid-way
(refused by the receiver's checksums and recomputed; the workers move real bytes with Mooncake,
so the test needs torch and Mooncake) and a gateway restarted mid-stream - over the real
3-server NATS cluster and services. The table must be all zero and ``verify`` of the
recorder's log must pass; no process of the stack may outlive the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_chaos import _still_alive, _Watch

pytestmark = pytest.mark.chaos  # its own suite after the default one (pyproject.toml, scripts/test.sh)

REPO = Path(__file__).resolve().parents[2]
ROWS = {"steady-load", "partition-engine", "kill-engine-prefill", "kill-engine-decode", "cut-kv-transfer",
        "restart-gateway"}


def _mooncake() -> str:
    try:
        from engine.transfer.mooncake import mooncake_available
    except ImportError as exc:  # torch missing
        return str(exc)
    ok, why = mooncake_available()
    return "" if ok else why


def test_engine_faults_quick_form_is_all_zero_and_leaves_nothing_running(tmp_path):
    why = _mooncake()
    if why:
        pytest.skip(f"cut-kv-transfer moves real KV bytes between workers with Mooncake: {why}")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "services.drivers.cli", "chaos", "--engines", "--quick", "--json",
                             "--workdir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    watch = _Watch(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("evolving chaos --engines --quick ran past 600 s")
    elapsed = time.monotonic() - t0
    children = watch.stop()
    assert stdout.strip(), stderr[-3000:]
    report = json.loads(stdout)
    rows = {r["name"]: r for r in report["scenarios"]}
    assert set(rows) == ROWS and report["engines"] and report["engine_backend"] == "sim"
    bad = {n: r for n, r in rows.items()
           if not r["survived"] or r["lost"] or r["hung"] or r["duplicated"] or r["diverged"]}
    assert not bad, json.dumps(bad, indent=1)
    assert report["verify"]["ok"] and report["verify"]["divergences"] == 0, report["verify"]
    assert report["unplanned_exits"] == [] and report["ok"] and proc.returncode == 0
    assert report["drain"]["ended"] == "settled", report["drain"]
    assert all(rc == 0 for rc in report["verify"]["stop_exit_codes"].values()), report["verify"]["stop_exit_codes"]
    assert "1 NodeRemoved" in rows["partition-engine"]["detail"]
    assert "re-routed and finished" in rows["kill-engine-prefill"]["detail"]
    assert "refused" in rows["cut-kv-transfer"]["detail"] and "the request finished" in rows["cut-kv-transfer"]["detail"]
    assert "no new BranchOpened" in rows["restart-gateway"]["detail"]
    assert sum("engine_faults" in c for c in children.values()) >= 4  # the watch saw the workers
    assert not _still_alive(children), "a process of the chaos stack outlived the command"
    print(f"chaos --engines --quick: {elapsed:.0f} s")
