"""The matrix's rows through an executor other than local processes (``evolving experiments
--ray``; tests/ray/ runs it on a real Ray cluster): a row's log written where its job ran and
shipped back lands in --out-dir with the same events as a row run here; a job that ends without a
result (its worker died) is that row's failure, not the matrix's end; and the CLI says what is
missing when Ray is not installed."""

from __future__ import annotations

import io
import os
import sys
from concurrent.futures import Executor, Future
from pathlib import Path

from rich.console import Console

from replay.experiments import run as run_mod
from replay.experiments.matrix import matrix
from replay.experiments.run import execute, log_digest, run_matrix
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


def _die_once(marker: str, run, log, seed):
    """A pool job: the first one to start dies (as the kernel's OOM killer ends a worker), every
    later one runs its row."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return execute(run, log, seed, False)
    os._exit(9)


def test_a_worker_that_dies_breaks_no_other_row_of_the_matrix(tmp_path, monkeypatch):
    """A dead worker process breaks a process pool: every row it held failed with
    BrokenProcessPool, the rows not started yet included, so one OOM kill ended the rest of a
    full matrix. The rows go to a fresh pool and run."""
    marker = str(tmp_path / "died")
    # the spawned workers unpickle _die_once by its module's name (pytest imports this file with
    # --import-mode=importlib, off sys.path): the checkout's root on the path they inherit
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    monkeypatch.setattr(run_mod, "_submit", lambda pool, run, log, seed, ship: pool.submit(_die_once, marker, run, log,
                                                                                        seed))
    out_file = io.StringIO()
    out = run_matrix(_start_split(), tmp_path / "out", Console(file=out_file, width=200), report=_collect, jobs=2)
    assert os.path.exists(marker)  # a worker did die
    assert [r.status for r in out[0]["runs"]] == ["ok", "ok"]
    assert "a worker process died" in out_file.getvalue()
    here = run_matrix(_start_split(), tmp_path / "here", Console(file=io.StringIO()), report=_collect, jobs=1)
    for mine, theirs in zip(out[0]["runs"], here[0]["runs"], strict=True):
        assert log_digest(mine.log) == log_digest(theirs.log)
