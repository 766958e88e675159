"""replay/sim/simlog.py: the simulator's log writer (process, thread, inline), its count check, --log-level."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from events.catalog import KvEvicted, KvStored, RequestFinished, RequestSubmitted, RouteDecided, Tick
from replay.sim.simlog import DECISION_LEVEL_TYPES, SimLog
from services.adapters.eventlog import DuckDbEventLog, EventLogError
from services.drivers.cli import main


def _stream(n: int) -> list:
    out = []
    for i in range(n):
        r = f"r{i}"
        out += [RequestSubmitted(ts=float(i), request=r, branch="b", blocks=list(range(i, i + 20))),
                RouteDecided(ts=float(i), request=r, prefill_node="n0", decode_node="n1"),
                KvStored(ts=float(i), node="n0", tier="L1", blocks=list(range(i, i + 20))),
                KvEvicted(ts=float(i), node="n0", tier="L2", blocks=[i]), Tick(ts=float(i)),
                RequestFinished(ts=float(i), request=r, node="n1", output_tokens=3)]
    return out


@pytest.mark.parametrize("writer", ["process", "thread", "inline"])
def test_the_writer_stores_every_event_in_order(tmp_path: Path, writer: str):
    evs = _stream(30)
    rec = SimLog(tmp_path / "run.duckdb", config={"seed": 0}, batch=7, queue_batches=1, writer=writer)
    for i, e in enumerate(evs, 1):
        rec(i, e)
    rec.close()
    st = rec.stats()
    assert st["log_events"] == len(evs) and st["log_level"] == "full" and st["log_format"] == "3"
    assert st["log_writer"] == writer and (st["log_writer_process_cpu_s"] > 0) == (writer == "process")
    assert st["log_bytes"] == (tmp_path / "run.duckdb").stat().st_size
    log = DuckDbEventLog(tmp_path / "run.duckdb", read_only=True)
    assert [e for _, _, e in log.read()] == evs
    assert log.run_config() == {"seed": 0, "log_level": "full"}
    log.close()


def test_decisions_level_keeps_what_the_tables_need_and_verify_refuses_it(tmp_path: Path, capsys):
    evs = _stream(5)
    rec = SimLog(tmp_path / "run.duckdb", config={"cores": ["router"]}, level="decisions", batch=4)
    for i, e in enumerate(evs, 1):
        rec(i, e)
    rec.close()
    kept = [(i, e) for i, e in enumerate(evs, 1) if type(e).__name__ in DECISION_LEVEL_TYPES]
    assert {type(e).__name__ for _, e in kept} == {"RequestSubmitted", "RouteDecided", "RequestFinished"}
    log = DuckDbEventLog(tmp_path / "run.duckdb", read_only=True)
    assert [(s, e) for s, _, e in log.read()] == kept  # gaps in seq where events were dropped
    log.close()
    assert main(["verify", str(tmp_path / "run.duckdb")]) == 2
    err = capsys.readouterr().err
    assert "recorded with --log-level decisions" in err and "--log-level full" in err


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_failed_writer_is_raised_and_nothing_is_lost_silently(tmp_path: Path, writer: str):
    rec = SimLog(tmp_path / "run.duckdb", batch=2, writer=writer)
    with pytest.raises(EventLogError, match="the log writer failed"):
        rec(1, Tick(ts=0.0))
        rec(2, RequestSubmitted(ts=0.0, request="r", branch="b", blocks=[1], src=None))  # src NOT NULL: fails
        for i in range(3, 9):
            rec(i, Tick(ts=float(i)))  # the simulation goes on (or hears of it at a batch); never blocks
        rec.close()
    with pytest.raises(ValueError, match="log level 'some'"):
        SimLog(tmp_path / "other.duckdb", level="some")
    with pytest.raises(ValueError, match="log writer 'elsewhere'"):
        SimLog(tmp_path / "other.duckdb", writer="elsewhere")


def test_a_writer_process_that_dies_is_an_error_at_close_not_a_hang(tmp_path: Path):
    rec = SimLog(tmp_path / "run.duckdb", batch=2, queue_batches=1, writer="process")
    rec(1, Tick(ts=0.0))
    rec(2, Tick(ts=1.0))
    os.kill(rec._proc.pid, signal.SIGKILL)
    rec._proc._proc.wait()
    with pytest.raises(EventLogError, match=r"writer process exited \(code -9\)"):
        for i in range(3, 40):  # batches to a dead writer: refused once the queue stays full
            rec(i, Tick(ts=float(i)))
        rec.close()


def test_the_writer_process_does_not_run_the_callers_main_module_again(tmp_path: Path):
    """A script without a ``__main__`` guard that writes a log: its top level runs once (a
    ``multiprocessing`` spawn child would import it again and run the simulation twice)."""
    import subprocess
    import sys

    marker = tmp_path / "ran"
    script = tmp_path / "script.py"
    script.write_text(
        "from pathlib import Path\n"
        "from events.catalog import Tick\n"
        "from replay.sim.simlog import SimLog\n"
        f"m = Path({str(marker)!r})\n"
        "m.write_text(m.read_text() + 'x' if m.exists() else 'x')\n"
        f"rec = SimLog(Path({str(tmp_path / 'run.duckdb')!r}), batch=1, writer='process')\n"
        "for i in range(1, 4):\n"
        "    rec(i, Tick(ts=float(i)))\n"
        "rec.close()\n"
        "print(rec.stats()['log_events'])\n")
    out = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[4])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3" and marker.read_text() == "x"
