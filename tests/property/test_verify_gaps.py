"""`verify` names exactly the rows deleted from a log: for any set of rows deleted
from a recorded DuckDB file - its first, its last, runs, all of them - the report's gaps are
the deleted seqs as ranges, nothing else, and the verdict is not OK unless nothing was deleted.
Seqs the recorder was not handed (noted in the log) are never gaps."""

from __future__ import annotations

import itertools
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.adapters.eventlog import DuckDbEventLog
from services.drivers.recorder.verify import CoreSpec, _checks_planner, _checks_router, verify_log
from tests.hyp import examples
from tests.unit.drivers.recorder.fakecores import FakePlanner, FakeRouter, inputs, live_log

REGISTRY = {
    "router": CoreSpec("router", lambda cfg: FakeRouter(), _checks_router),
    "planner": CoreSpec("planner", lambda cfg: FakePlanner(), _checks_planner),
}
#: the recorder was not handed seqs 1-3 (the stream began before it) and 20 (junk it dead-lettered)
NOT_HANDED = {1, 2, 3, 20}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    rows = live_log(inputs(8), [FakeRouter(), FakePlanner()], delay=1)
    seqs = list(itertools.islice((s for s in itertools.count(1) if s not in NOT_HANDED), len(rows)))
    path = tmp_path_factory.mktemp("gaps") / "base.duckdb"
    log = DuckDbEventLog(path)
    log.append([(seq, subj, ev) for seq, (_, subj, ev) in zip(seqs, rows, strict=True)])
    log.set_run_config({"cores": ["router", "planner"]})
    log.close()
    return path, seqs


def ranges(seqs):
    out = []
    for s in sorted(seqs):
        if out and out[-1][1] == s - 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


@settings(max_examples=examples(12), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_verify_reports_exactly_the_deleted_seqs(base, tmp_path_factory, data):
    path, seqs = base
    deleted = data.draw(st.sets(st.sampled_from(seqs)), label="deleted")
    copy = tmp_path_factory.mktemp("cut") / "run.duckdb"
    shutil.copyfile(path, copy)
    if deleted:
        log = DuckDbEventLog(copy)
        log.con.execute("DELETE FROM event_rows WHERE list_contains(?, seq)", [sorted(deleted)])
        log.close()
    log = DuckDbEventLog(copy, read_only=True)
    try:
        report = verify_log(log, registry=REGISTRY)
    finally:
        log.close()
    assert report.gaps == ranges(deleted)
    assert report.skipped == [(1, 3), (20, 20)]
    assert report.complete == (not deleted) and (report.ok or bool(deleted))
    assert report.ok == (not deleted)
