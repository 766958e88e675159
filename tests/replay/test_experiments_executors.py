"""The matrix's rows through an executor other than local processes (``evolving experiments
--ray``; tests/ray/ runs it on a real Ray cluster): a row's log written where its job ran and
shipped back lands in --out-dir with the same events as a row run here; a job that ends without a
result (its worker died) is that row's failure, not the matrix's end; and the CLI says what is
missing when Ray is not installed."""

from __future__ import annotations

import io
import sys
from concurrent.futures import Executor, Future
from pathlib import Path

from rich.console import Console

from replay.experiments.matrix import matrix
from replay.experiments.run import log_digest, run_matrix
from services.adapters.executors import InlineExecutor
from services.drivers.cli import main


def _collect(exp, results, out_dir, console, quick) -> dict:
    return {"name": exp.name, "runs": results}


def _start_split():
    return [e for e in matrix(True, tiny=True) if e.name == "start-split"]


def test_shipped_rows_land_in_the_out_dir_with_the_same_events_as_rows_run_here(tmp_path):
    console = Console(file=io.StringIO())
    here = run_matrix(_start_split(), tmp_path / "here", console, report=_collect, jobs=1)
    shipped = run_matrix(_start_split(), tmp_path / "shipped", console, report=_collect,
                         executor=InlineExecutor(), ship_logs=True)
    pairs = list(zip(shipped[0]["runs"], here[0]["runs"], strict=True))
    assert len(pairs) == 2
    for mine, theirs in pairs:
        assert mine.status == theirs.status == "ok"
        assert Path(mine.log).parent == tmp_path / "shipped" / "start-split" and Path(mine.log).exists()
        n, digest = log_digest(mine.log)
        assert n > 100 and (n, digest) == log_digest(theirs.log)
        assert Path(mine.log + ".key").exists()  # --resume works on shipped rows too
    assert not list((tmp_path / "shipped").rglob("*.part"))


class _DeadWorkers(Executor):
    """Every job ends without a result, as when a Ray node dies under it."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        f.set_exception(RuntimeError("the worker died"))
        return f


def test_a_job_without_a_result_is_its_rows_failure_and_the_matrix_goes_on(tmp_path):
    console = Console(file=io.StringIO())
    out = run_matrix(_start_split(), tmp_path, console, report=_collect, executor=_DeadWorkers(), ship_logs=True)
    assert [r.status for r in out[0]["runs"]] == ["failed: RuntimeError: the worker died"] * 2


def test_ray_flags_say_what_is_missing(tmp_path, monkeypatch, capsys):
    base = ["experiments", "--tiny", "--only", "start-split", "--out-dir", str(tmp_path), "--no-progress"]
    assert main([*base, "--ray-shared"]) == 2
    assert "--ray-shared goes with --ray ADDRESS" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as where the ray extra is not installed
    assert main([*base, "--ray", "local"]) == 2
    err = capsys.readouterr().err
    assert "ray is not installed" in err and "scripts/install_ray.sh" in err
    assert not (tmp_path / "summary.json").exists()
