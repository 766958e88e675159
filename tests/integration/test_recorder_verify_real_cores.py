"""Replay determinism of the real cores: a run driven the way live adapters drive it, stored
in DuckDB, is reproduced decision for decision by `evolving verify` (and a forged model fit is
caught). Skipped while a core module is missing."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from events.catalog import BranchOpened, IterationDone, ModelFitted, NodeRegistered, RequestSubmitted, Tick
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.cli import main
from services.drivers.recorder.verify import build_cores
from tests.unit.drivers.recorder.fakecores import live_log

for mod in ("services.cores.directory.core", "services.cores.planner.evolving", "services.cores.router.least_ttft"):
    pytest.importorskip(mod, exc_type=ImportError)  # a peer's core mid-edit must not break collection

CONFIG = {
    "cores": ["directory", "planner", "router"],
    "planner": {"plugin": "evolving", "kwargs": {"window_s": 4.0, "slices": 4, "warmup_s": 0.0,
                                                  "cooldown_s": 0.0, "fit_interval_s": 1.0}},
    "router": {"plugin": "evolving", "kwargs": {"name": "evolving"}},
}


def inputs(n: int = 200, seed: int = 1):
    rng = random.Random(seed)
    evs = [NodeRegistered(ts=0.0, node=f"n{i}", role="prefill" if i < 1 else "decode",
                          l1_capacity_tokens=10**6, l2_capacity_tokens=10**7) for i in range(4)]
    t = 1.0
    for i in range(n):
        t += 0.05
        uc, b = rng.randrange(1000, 8000), rng.randrange(1, 64)
        evs += [
            BranchOpened(ts=t, branch=f"b{i}"),
            RequestSubmitted(ts=t, request=f"r{i}", branch=f"b{i}", blocks=[rng.getrandbits(64) for _ in range(40)],
                             prompt_tokens=40 * 64 + 3, max_tokens=50),
            IterationDone(ts=t, node="n0", phase="prefill", duration_s=0.01 + uc * 2e-5, batch=1, sum_t_uc=uc,
                          sum_A=uc * uc / 2),
            IterationDone(ts=t, node="n1", phase="decode", duration_s=0.02 + b * 1e-4, batch=b),
        ]
        if i % 10 == 9:
            evs.append(Tick(ts=t + 0.01))
    return evs


@pytest.fixture(scope="module")
def run_rows():
    cores = [c for _, c in build_cores(CONFIG, CONFIG["cores"])]
    return live_log(inputs(), cores, delay=2)


def write(path, rows):
    log = DuckDbEventLog(path)
    log.append(rows)
    log.set_run_config(CONFIG)
    log.close()


def test_real_cores_reproduce_every_recorded_decision(tmp_path, capsys, run_rows):
    write(tmp_path / "run.duckdb", run_rows)
    assert main(["verify", str(tmp_path / "run.duckdb"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["reproduced"].get("RouteDecided", 0) > 0 and out["reproduced"].get("ModelFitted", 0) > 0


def test_a_forged_model_fit_is_caught(tmp_path, capsys, run_rows):
    rows = list(run_rows)
    seq, subj, fit = next(r for r in rows if isinstance(r[2], ModelFitted))
    forged = msgspec.structs.replace(fit, coefficients=[c * 1.01 for c in fit.coefficients])
    rows[seq - 1] = (seq, subj, forged)
    write(tmp_path / "run.duckdb", rows)
    assert main(["verify", str(tmp_path / "run.duckdb"), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["first_divergence"]
    assert (first["seq"], first["core"], first["kind"]) == (seq, "planner", "mismatch")


def test_a_log_recorded_before_the_layout_still_verifies(tmp_path, capsys, run_rows):
    """Logs written before the layered folders name the cores by their old class paths
    (``services.planner.core:...``); ``evolving verify`` resolves them through the alias table
    (services/drivers/services.py, LEGACY_CLASS_PATHS)."""
    old = {"cores": ["directory", "planner", "router"],
           "directory": {"class": "services.directory.core:DirectoryCore", "kwargs": {}},
           "planner": {"class": "services.planner.core:EvolvingPlanner", "kwargs": CONFIG["planner"]["kwargs"]},
           "router": {"class": "services.router.core:LeastTtftRouter", "kwargs": CONFIG["router"]["kwargs"]}}
    log = DuckDbEventLog(tmp_path / "old.duckdb")
    log.append(run_rows)
    log.set_run_config(old)
    log.close()
    assert main(["verify", str(tmp_path / "old.duckdb"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["reproduced"].get("RouteDecided", 0) > 0 and out["reproduced"].get("ModelFitted", 0) > 0
