"""``evolving chaos --engines vllm`` (``pytest -m vllm``): two real vLLM servers
on SmolLM2, a worker attached to each, over the real 3-server NATS cluster and services - a
worker SIGKILLed mid-decode, a vLLM server SIGKILLed mid-decode and started again, a KV-event
socket cut and mended. The table must be all zero (no event lost or duplicated, no decision
diverged, no request left hanging), ``verify`` of the recorder's log must pass, and no process of
the stack - vLLM servers included - may outlive the command."""

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

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
ROWS = ["steady-load", "kill-engine-decode", "kill-vllm-server", "cut-kv-events"]


def test_vllm_faults_are_all_zero_and_leave_nothing_running(hf_model, tmp_path):
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "services.drivers.cli", "chaos", "--engines", "vllm", "--json",
                             "--workdir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    watch = _Watch(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=3000)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("evolving chaos --engines vllm ran past 3000 s")
    children = watch.stop()
    assert stdout.strip(), stderr[-3000:]
    report = json.loads(stdout)
    rows = {r["name"]: r for r in report["scenarios"]}
    assert list(rows) == ROWS and report["engine_backend"] == "vllm"
    bad = {n: r for n, r in rows.items()
           if not r["survived"] or r["lost"] or r["hung"] or r["duplicated"] or r["diverged"]}
    assert not bad, json.dumps(bad, indent=1)
    assert report["verify"]["ok"] and report["verify"]["divergences"] == 0, report["verify"]
    assert report["unplanned_exits"] == [] and report["ok"] and proc.returncode == 0
    assert "the directory held 0 of the old server's" in rows["kill-vllm-server"]["detail"]
    assert "its view refilled" in rows["cut-kv-events"]["detail"]
    assert sum("vllm.entrypoints.openai.api_server" in c for c in children.values()) >= 2  # the watch saw them
    assert not _still_alive(children), "a process of the chaos stack outlived the command"
    print(f"chaos --engines vllm: {time.monotonic() - t0:.0f} s")
