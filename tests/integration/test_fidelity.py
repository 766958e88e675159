"""``evolving fidelity`` shrunk by its own flags: one stack (static 1P1D), two torch engines
computing with a tiny random Llama checkpoint, two real sessions of two turns, a profile
calibrated by the fitter (replay/fidelity/calibrate.py) from iteration events of known
coefficients. The live run goes through a real ``evolving up`` (its own nats-server, gateway,
recorder); the simulated run through the simulator; the test reads the JSON rows and both kept
logs. A static split with one prefill node reuses exactly the prefixes the sessions share,
whatever the timing, so live and simulated prefix hit rates must agree."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

MISSING = [m for m in ("torch", "tokenizers", "jinja2") if importlib.util.find_spec(m) is None]
if MISSING:
    pytest.skip(f"missing {MISSING}", allow_module_level=True)

from engine.backends.torch.loader import random_weights, write_safetensors
from replay.fidelity.calibrate import calibrate_events, profile_toml
from services.adapters.eventlog import DuckDbEventLog
from tests.unit.drivers.gateway.test_model import tiny_vocab, write_tiny_folder
from tests.unit.engine.torch.cluster import TINY
from tests.unit.replay.fidelity.test_calibrate import synthetic_run

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "traces" / "weka-claude-code"


@pytest.mark.stack
def test_fidelity_one_stack_live_and_simulated(tmp_path):
    model = tmp_path / "tiny"
    cfg = replace(TINY, vocab=len(tiny_vocab()[0]))
    write_safetensors(model, cfg, random_weights(cfg, seed=3))
    write_tiny_folder(model)
    prof = tmp_path / "cal.toml"
    prof.write_text(profile_toml(calibrate_events(synthetic_run(), source="synthetic"), "cal"))
    out = tmp_path / "fid"
    run = subprocess.run(
        [sys.executable, "-m", "services.drivers.cli", "fidelity", "--trace", str(FIXTURES), "--stacks", "static:1P1D",
         "--engines", "2", "--sessions", "2", "--calibration-sessions", "0", "--concurrency", "2", "--turns", "2",
         "--token-scale", "64", "--max-output", "4", "--pause-scale", "0.01", "--warmup-s", "5",
         "--model", str(model), "--profile", str(prof), "--out-dir", str(out), "--json"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout)
    assert "token lengths / 64" in run.stderr  # the scaling is said
    rows = {r["metric"]: r for r in res["rows"]}
    assert {r["stack"] for r in res["rows"]} == {"static:1P1D"}
    assert set(rows) >= {"throughput_rps", "ttft_p50_s", "ttft_p95_s", "e2e_mean_s", "prefix_hit", "role_switches"}
    assert rows["finished"]["live"] == rows["finished"]["sim"] == res["workload"]["requests"] == 4
    assert rows["throughput_rps"]["live"] > 0 and rows["throughput_rps"]["sim"] > 0
    assert rows["prefix_hit"]["live"] == pytest.approx(rows["prefix_hit"]["sim"], abs=0.02)
    assert rows["role_switches"]["live"] == rows["role_switches"]["sim"] == 0  # a static split never switches
    info = res["stacks"][0]
    assert info["requests_failed"] == 0
    for key in ("live_log", "sim_log"):  # both logs kept, each with the four requests
        with DuckDbEventLog(info[key], read_only=True) as log:
            assert log.count_by_type().get("RequestFinished") == 4, key
