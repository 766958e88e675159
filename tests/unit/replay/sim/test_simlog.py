"""replay/sim/simlog.py: the simulator's log writer thread, its count check, --log-level."""

from __future__ import annotations

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


def test_the_writer_thread_stores_every_event_in_order(tmp_path: Path):
    evs = _stream(30)
    rec = SimLog(tmp_path / "run.duckdb", config={"seed": 0}, batch=7, queue_batches=1)
    for i, e in enumerate(evs, 1):
        rec(i, e)
    rec.close()
    st = rec.stats()
    assert st["log_events"] == len(evs) and st["log_level"] == "full" and st["log_format"] == "3"
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


def test_a_failed_writer_is_raised_at_close_and_nothing_is_lost_silently(tmp_path: Path):
    rec = SimLog(tmp_path / "run.duckdb", batch=2)
    rec(1, Tick(ts=0.0))
    rec(2, RequestSubmitted(ts=0.0, request="r", branch="b", blocks=[1], src=None))  # src NOT NULL: the insert fails
    for i in range(3, 9):
        rec(i, Tick(ts=float(i)))  # the simulation goes on; the writer keeps taking batches
    with pytest.raises(EventLogError, match="the log writer failed"):
        rec.close()
    with pytest.raises(ValueError, match="log level 'some'"):
        SimLog(tmp_path / "other.duckdb", level="some")
