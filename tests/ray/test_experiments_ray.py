"""``evolving experiments --ray ADDRESS`` on a real local Ray cluster (tests/ray/conftest.py):
the rows run as Ray tasks in the cluster's workers, their logs land in --out-dir here (shipped
back, or written by the workers with --ray-shared), and every row makes the same run as the local
runner: the same event-log digest, the same metrics."""

from __future__ import annotations

import json
import os

import pytest

from replay.experiments.run import log_digest
from services.drivers.cli import main

pytestmark = pytest.mark.ray

BASE = ["experiments", "--tiny", "--only", "start-split", "--no-progress"]  # 2 rows of a few seconds


def _rows(out) -> list[dict]:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"]
    return [r for e in summary["experiments"] for r in e["runs"]]


def test_rows_as_ray_tasks_make_the_same_runs_as_local_processes(ray_cluster, tmp_path, capsys):
    assert main([*BASE, "--out-dir", str(tmp_path / "local"), "--jobs", "1"]) == 0
    local = _rows(tmp_path / "local")
    capsys.readouterr()
    for mode, extra in (("shipped", []), ("shared", ["--ray-shared"])):
        out = tmp_path / mode
        assert main([*BASE, "--out-dir", str(out), "--ray", ray_cluster, *extra]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "as Ray tasks (Ray " in text and f"at {ray_cluster}: 2 CPUs on 1 node(s)" in text
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ray"]["address"] == ray_cluster and summary["jobs"] == 2
        assert summary["ray"]["logs"] == ("shipped back" if mode == "shipped" else "written in --out-dir by the workers")
        rows = _rows(out)
        assert [r["label"] for r in rows] == [r["label"] for r in local] == ["start 1P8D", "start 8P1D"]
        for mine, theirs in zip(rows, local, strict=True):
            assert mine["status"] == "ok", mine
            assert os.path.samefile(os.path.dirname(mine["log"]), out / "start-split")
            assert str(os.getpid()) not in mine["ran_on"].split()  # a Ray worker ran it, not this process
            n, digest = log_digest(mine["log"])
            assert n > 100 and (n, digest) == log_digest(theirs["log"]), mine["label"]
            assert mine["metrics"] == theirs["metrics"]
            assert (out / "start-split" / (os.path.basename(mine["log"]) + ".key")).exists()
        assert not list(out.rglob("*.part"))
