"""The log side of the hostile suite: a run of the real cores with forgeries, a NaN
timestamp and junk bytes on the stream, recorded into DuckDB by the recorder service, then
`evolving verify`: OK with every forgery named as refused; and the same file with rows deleted
from it: the missing seqs named, exit 3. Bus: the in-process twin (the recorder and the bytes
on the wire are the real ones; the subject permissions are not what is tested here)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil

import pytest

from events import codec
from events.catalog import IterationDone, NodeHeartbeat, NodeRemoved, RouteDecided, SwitchRole
from services.adapters.bus import InMemoryBus
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.cli import main
from services.drivers.recorder.service import run_recorder
from services.drivers.recorder.verify import build_cores
from tests.integration.test_recorder_verify_real_cores import CONFIG, inputs
from tests.unit.drivers.recorder.fakecores import live_log

JUNK = b"\xc1junk"  # the 5 bytes: the recorder's consumer dead-letters them

FORGED = [
    (40, "ei.default.agent.b9", SwitchRole(ts=1.5, node="n1", to_role="prefill")),  # the gateway's account
    (80, "ei.default.node.n0", NodeRemoved(ts=2.5, node="n1", reason="forged")),  # engine n0, about n1
    (120, "ei.default.node.n2", NodeHeartbeat(ts=float("nan"), node="n2", role="decode")),  # engine n2, NaN
    # engine n2 about itself, an hour ahead (a far-future Tick is the planner's own: the clock)
    (160, "ei.default.node.n2", IterationDone(ts=4000.0, node="n2", phase="decode", duration_s=0.01)),
]


def stream():
    """What the live services put on the stream: the run, the forgeries (refused, never folded)."""
    evs = list(inputs(120))
    for pos, subject, ev in reversed(FORGED):
        evs.insert(pos, (subject, ev))
    cores = [c for _, c in build_cores(CONFIG, CONFIG["cores"])]
    return live_log(evs, cores, delay=2, authority=True)


async def record(path, rows, junk_at: int) -> int:
    """Publish ``rows`` (junk bytes before the ``junk_at``-th) and record the stream into ``path``."""
    bus = InMemoryBus()
    for i, (_, subject, ev) in enumerate(rows):
        if i == junk_at:
            await bus.publish_raw(subject, JUNK, codec.headers())
        await bus.publish_raw(subject, codec.encode(ev), codec.headers())
    last = await bus.last_seq()
    log = DuckDbEventLog(path)
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, max_batch=128, flush_interval_s=0.02, stop=stop))
    for _ in range(500):
        if log.last_seq() == last:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await task
    log.set_run_config(CONFIG)
    log.close()
    return last


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    rows = stream()
    path = tmp_path_factory.mktemp("hostile") / "run.duckdb"
    junk_at = 100
    last = asyncio.run(record(path, rows, junk_at))
    assert last == len(rows) + 1
    # stream seq of each forgery: rows before the junk keep their position, the rest move one up
    seqs = {type(ev).__name__: s + (s > junk_at) for s, _, ev in rows if any(ev is f[2] for f in FORGED)}
    assert len(seqs) == len(FORGED)
    return path, rows, junk_at + 1, seqs


def verify(capsys, path, *more):
    rc = main(["verify", str(path), *more])
    return rc, capsys.readouterr()


def test_forgeries_and_a_nan_ts_are_recorded_readable_and_refused_by_verify(recorded, capsys):
    path, rows, junk_seq, seqs = recorded
    rc, cap = verify(capsys, path, "--json")
    out = json.loads(cap.out)
    assert rc == 0 and out["ok"] and out["complete"], out
    assert [(r["seq"], r["type"]) for r in out["refusals"]] == sorted((s, t) for t, s in seqs.items())
    by_type = {r["type"]: r for r in out["refusals"]}
    assert by_type["SwitchRole"]["subject"] == "ei.default.agent.b9"
    assert "NodeRemoved about 'n1' may not be published on 'ei.default.node.n0'" in by_type["NodeRemoved"]["reason"]
    assert by_type["NodeHeartbeat"]["reason"] == "ts is not a finite number (nan)"
    assert "ahead of the stream's time" in by_type["IterationDone"]["reason"]
    # the cores' decisions are reproduced, every one
    routes = sum(isinstance(e, RouteDecided) for _, _, e in rows)
    assert out["reproduced"]["RouteDecided"] == routes > 100 and out["reproduced"].get("ModelFitted", 0) > 0
    assert out["events"] == len(rows) and out["folded"] == len(rows) - 4
    # the junk's seq: noted by the recorder as not handed to it, not a gap
    assert out["skipped_ranges"] == [[junk_seq, junk_seq]] and out["missing"] == 0
    # the NaN row reads back with its NaN, and SQL reads it too
    log = DuckDbEventLog(path, read_only=True)
    (ts,) = log.con.execute("SELECT ts FROM events WHERE seq = ?", [seqs["NodeHeartbeat"]]).fetchone()
    ev = next(e for s, _, e in log.read(seqs["NodeHeartbeat"]))
    log.close()
    assert math.isnan(ts) and math.isnan(ev.ts) and ev.node == "n2"


def test_the_text_report_names_each_refusal(recorded, capsys):
    path, _, _, seqs = recorded
    rc, cap = verify(capsys, path)
    assert rc == 0
    assert f"seq {seqs['SwitchRole']} on ei.default.agent.b9: SwitchRole: " in cap.out
    assert f"seq {seqs['NodeHeartbeat']} on ei.default.node.n2: NodeHeartbeat: ts is not a finite number" in cap.out
    assert "OK: every recorded decision was reproduced exactly" in cap.out


def test_rows_deleted_from_the_recorded_file_fail_verify_by_name(recorded, capsys, tmp_path):
    path, rows, _, seqs = recorded
    cut = tmp_path / "cut.duckdb"
    shutil.copyfile(path, cut)
    log = DuckDbEventLog(cut)
    log.con.execute("DELETE FROM event_rows WHERE seq IN (1, 57, 58, ?)", [seqs["NodeRemoved"]])
    log.close()
    rc, cap = verify(capsys, cut)
    assert rc == 3, cap.out
    assert f"GAP: 4 seq(s) missing from the log (applied position {len(rows) + 1}): seqs 1, 57-58, " \
           f"{seqs['NodeRemoved']} (deleted from the log after they were recorded)" in cap.out
    assert "INCOMPLETE" in cap.out
    rc, cap = verify(capsys, cut, "--json", "--keep-going")
    out = json.loads(cap.out)
    assert rc == 3 and not out["ok"] and out["gaps"] == [[1, 1], [57, 58], [seqs["NodeRemoved"]] * 2]
