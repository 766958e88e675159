"""``evolving experiments --ray ADDRESS`` on a real local Ray cluster (tests/ray/conftest.py):
the rows run as Ray tasks in the cluster's workers, their logs land in --out-dir here (shipped
back, or written by the workers with --ray-shared), and every row makes the same run as the local
runner: the same event-log digest, the same metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def _children(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def test_ray_local_runs_on_an_instance_of_its_own_and_stops_it(ray_cluster, tmp_path, capsys):
    """``--ray local`` (Ray's own meaning: a new instance for this command) with ``--jobs 2``:
    the row runs in its workers and nothing of the instance outlives the command. (``ray_cluster``
    only for the auth token it puts in the environment: Ray reads it once per process, so the
    instance gets the same one, and nothing is read from or written to ~/.ray.)"""
    before = _children(os.getpid())
    out = tmp_path / "local"
    assert main([*BASE, "--rows", "start 1P8D", "--out-dir", str(out), "--ray", "local", "--jobs", "2"]) == 0
    assert "at local: 2 CPUs on 1 node(s)" in " ".join(capsys.readouterr().out.split())
    [row] = _rows(out)
    assert row["status"] == "ok" and str(os.getpid()) not in row["ran_on"].split()
    assert log_digest(row["log"])[0] > 100
    left = {p for p in _children(os.getpid()) - before if os.path.exists(f"/proc/{p}")}
    zombies = {p for p in left if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"}
    assert left == zombies, left  # Ray's shutdown stopped its daemons (a zombie is already dead)
