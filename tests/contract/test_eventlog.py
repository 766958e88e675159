"""One contract for the EventLog port, run against DuckDbEventLog and InMemoryEventLog."""

from __future__ import annotations

import abc

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import (
    EVENT_TYPES,
    AnomalyReported,
    BranchEnded,
    BranchOpened,
    Candidate,
    ContextCompacted,
    FetchStep,
    FirstToken,
    IterationDone,
    KvEvicted,
    KvFetched,
    KvMoved,
    KvStageOrdered,
    KvStored,
    ModelFitted,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    NodeScore,
    PlanEvaluated,
    RequestCancelled,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
    Split,
    SwitchRole,
    Tick,
)
from events.codec import CodecError, encode
from events.subjects import subject_for
from services.adapters.eventlog import DuckDbEventLog, EventLog, EventLogError, InMemoryEventLog
from services.adapters.eventlog.port import Skipped
from tests.hyp import examples

BIG = 2**64 - 1

ONE_OF_EACH = [
    BranchOpened(ts=0.5, src="gw", branch="b1", parent="b0", mode="fork", session="s"),
    RequestSubmitted(ts=1.0, src="gw", request="r1", branch="b1", version=2, blocks=[0, 1, BIG, 2**63],
                     prompt_tokens=300, max_tokens=20, block_tokens=64),
    ContextCompacted(ts=1.1, branch="b1", version=3, blocks=[5, 6]),
    BranchEnded(ts=1.2, branch="b1"),
    RequestCancelled(ts=1.25, src="gw", request="r1", branch="b1", reason="timeout"),
    KvStored(ts=1.3, node="n1", tier="L1", blocks=[BIG], request="r1"),
    KvEvicted(ts=1.4, node="n1", tier="L2", blocks=[7]),
    KvMoved(ts=1.5, src_node="n1", dst_node="n2", blocks=[8, 9], branch="b1"),
    KvFetched(ts=1.6, request="r1", src_node="n3", dst_node="n1", blocks=[1], duration_s=0.1, hidden_s=0.05),
    NodeRegistered(ts=0.0, node="n1", role="prefill", gpus=8, l1_capacity_tokens=10**6, profile="gb300"),
    NodeHeartbeat(ts=1.7, node="n1", role="prefill", running=3, queued=1),
    NodeRemoved(ts=1.8, node="n9", reason="missed heartbeats"),
    IterationDone(ts=1.9, node="n1", phase="prefill", duration_s=0.0123456789, batch=3, sum_t_uc=1000,
                  sum_A=1.5e6, sum_t_rst=64, sum_t_c=128, t_fwd=1.0, accepted_tokens=0, queued=2),
    RequestStarted(ts=2.0, request="r1", node="n1", phase="prefill"),
    FirstToken(ts=2.1, request="r1", node="n1"),
    RequestFinished(ts=2.2, request="r1", node="n2", output_tokens=20, error=""),
    RouteDecided(ts=1.05, src="router", request="r1", prefill_node="n1", decode_node="n2", t_c=128, t_uc=172,
                 fetch_plan=[FetchStep(src_node="n3", first_block=2, n_blocks=1)], predicted_ttft_s=0.1 + 0.2,
                 policy="evolving", scores=[NodeScore(node="n1", score=0.3, t_c=128, queue_s=0.01)],
                 branch="b1"),
    KvStageOrdered(ts=2.2, src="router", request="r1", src_node="n2", dst_node="n1", branch="b1", tier="L2",
                   predicted_ttft_s=0.05, policy="prestage"),
    ModelFitted(ts=3.0, node="n1", phase="prefill", coefficients=[1e-3, 2.5e-5, 1e-10, 3e-7], samples=9,
                mape=0.031),
    PlanEvaluated(ts=3.0, window_start=0.0, window_end=3.0, current=Split(prefill=2, decode=2),
                  candidates=[Candidate(split=Split(prefill=3, decode=1), mean_gain=0.2, se=0.05, passed=True)],
                  chosen=Split(prefill=3, decode=1), reason="gain", planner="evolving"),
    RoleSwitchOrdered(ts=3.0, node="n2", from_role="decode", to_role="prefill", reason="plan"),
    AnomalyReported(ts=3.1, component="directory", kind="unknown_branch", ref="b9"),
    SwitchRole(ts=3.0, node="n2", to_role="prefill"),
    RoleSwitched(ts=4.0, node="n2", role="prefill", drained=2, duration_s=1.0),
    Tick(ts=5.0, src="planner"),
]


def rows(events, start=1):
    return [(start + i, subject_for(e), e) for i, e in enumerate(events)]


def ticks(seqs):
    return [(s, "ei.default.clock", Tick(ts=float(s))) for s in seqs]


class EventLogContract(abc.ABC):
    """What every EventLog backend guarantees."""

    @abc.abstractmethod
    def make(self, tmp_path) -> EventLog: ...

    @abc.abstractmethod
    def reopen(self, log: EventLog, tmp_path) -> EventLog:
        """The same log after a restart (closed and opened again, where that means anything)."""

    def test_empty(self, tmp_path):
        log = self.make(tmp_path)
        assert log.last_seq() == 0
        assert list(log.read()) == []
        assert log.count_by_type() == {}

    def test_every_event_type_round_trips_exactly(self, tmp_path):
        missing = set(EVENT_TYPES) - {type(e) for e in ONE_OF_EACH}
        assert not missing, f"add a sample of each new event type to ONE_OF_EACH: {missing}"
        log = self.make(tmp_path)
        batch = rows(ONE_OF_EACH)
        assert log.append(batch) == len(batch)
        back = list(log.read())
        assert [(s, subj) for s, subj, _ in back] == [(s, subj) for s, subj, _ in batch]
        assert [encode(e) for _, _, e in back] == [encode(e) for _, _, e in batch]
        assert [type(e) for _, _, e in back] == [type(e) for _, _, e in batch]

    def test_redelivered_batch_is_a_no_op(self, tmp_path):
        log = self.make(tmp_path)
        assert log.append(ticks([1, 2, 3])) == 3
        assert log.append(ticks([1, 2, 3])) == 0
        assert log.append(ticks([2, 3, 4, 5])) == 2
        assert [s for s, _, _ in log.read()] == [1, 2, 3, 4, 5]
        assert log.last_seq() == 5
        assert log.count_by_type() == {"Tick": 5}

    def test_batch_is_sorted_and_deduplicated(self, tmp_path):
        log = self.make(tmp_path)
        assert log.append(ticks([3, 1, 2, 3, 1])) == 3
        assert [s for s, _, _ in log.read()] == [1, 2, 3]

    def test_gaps_are_allowed_and_a_lower_seq_after_them_is_a_redelivery(self, tmp_path):
        log = self.make(tmp_path)
        assert log.append(ticks([1, 5, 9])) == 3
        assert log.append(ticks([7, 10])) == 1  # 7 <= applied 9: a redelivery by definition
        assert [s for s, _, _ in log.read()] == [1, 5, 9, 10]
        assert [s for s, _, _ in log.read(6)] == [9, 10]
        assert [s for s, _, _ in log.read(11)] == []

    def test_invalid_seq_is_refused_and_stores_nothing(self, tmp_path):
        log = self.make(tmp_path)
        with pytest.raises(ValueError, match="positive int"):
            log.append([*ticks([1]), (0, "x", Tick(ts=0.0))])
        assert log.last_seq() == 0 and list(log.read()) == []

    def test_count_by_type(self, tmp_path):
        log = self.make(tmp_path)
        log.append(rows([Tick(ts=1.0), FirstToken(ts=2.0, request="r", node="n"), Tick(ts=3.0)]))
        assert log.count_by_type() == {"FirstToken": 1, "Tick": 2}

    def test_read_filters_by_type_in_seq_order(self, tmp_path):
        log = self.make(tmp_path)
        log.append(rows(ONE_OF_EACH))
        want = {"RequestSubmitted", "Tick", "KvStored"}
        got = list(log.read(types=want))
        assert [type(ev).__name__ for _, _, ev in got] == [type(e).__name__ for e in ONE_OF_EACH
                                                            if type(e).__name__ in want]
        assert [seq for seq, _, _ in got] == [i + 1 for i, e in enumerate(ONE_OF_EACH) if type(e).__name__ in want]
        assert [ev for _, _, ev in log.read(from_seq=3, types={"Tick"})] == [ONE_OF_EACH[-1]]
        assert list(log.read(types=())) == []
        assert [r[0] for r in log.read(types=None)] == [r[0] for r in log.read()]

    def test_state_survives_reopen(self, tmp_path):
        log = self.make(tmp_path)
        log.append(ticks([1, 2]))
        log.set_run_config({"router": {"plugin": "evolving", "kwargs": {"name": "r", "shadow": False}}})
        log = self.reopen(log, tmp_path)
        assert log.last_seq() == 2
        assert log.append(ticks([2, 3])) == 1
        assert [s for s, _, _ in log.read()] == [1, 2, 3]
        assert log.run_config() == {"router": {"plugin": "evolving", "kwargs": {"name": "r", "shadow": False}}}

    def test_run_config_upserts_keys(self, tmp_path):
        log = self.make(tmp_path)
        log.set_run_config({"a": 1, "b": {"x": [1, 2]}})
        log.set_run_config({"a": "two"})
        assert log.run_config() == {"a": "two", "b": {"x": [1, 2]}}

    # ---------------------------------------------------------------- a bad row is one row
    @abc.abstractmethod
    def corrupt(self, log: EventLog, seq: int, payload: str) -> None:
        """Overwrite row ``seq``'s stored payload (an edited or damaged file)."""

    def test_non_finite_floats_round_trip_anywhere_in_an_event(self, tmp_path):
        """The stream takes any msgpack float; JSON has no NaN: one such event made the log unreadable."""
        nan, inf = float("nan"), float("inf")
        evs = [Tick(ts=nan), Tick(ts=inf, src="x"), Tick(ts=-inf),
               IterationDone(ts=1.0, node="n1", phase="prefill", duration_s=inf, batch=1, sum_A=nan),
               RouteDecided(ts=nan, request="r", prefill_node="n1", decode_node="n1", predicted_ttft_s=-inf,
                            scores=[NodeScore(node="n1", score=nan)], branch="NaN"),
               PlanEvaluated(ts=2.0, window_start=0.0, window_end=inf, current=Split(prefill=1, decode=1),
                             candidates=[Candidate(split=Split(prefill=2, decode=0), mean_gain=nan, se=inf)]),
               ModelFitted(ts=2.0, node="n1", phase="prefill", coefficients=[1.0, nan, -inf], mape=nan),
               RequestSubmitted(ts=nan, request="r2", branch="Infinity", blocks=[1, BIG, 3], prompt_tokens=200),
               Tick(ts=4.0)]
        log = self.make(tmp_path)
        log.append(rows(evs))
        log = self.reopen(log, tmp_path)
        back = [e for _, _, e in log.read()]
        assert [encode(e) for e in back] == [encode(e) for e in evs]  # NaN's bits included
        assert back[-1] == evs[-1] and back[4].branch == "NaN" and back[7].branch == "Infinity"

    def test_an_undecodable_row_is_named_and_the_rest_still_reads(self, tmp_path):
        log = self.make(tmp_path)
        log.append(ticks([1, 2, 3, 4]))
        self.corrupt(log, 2, '{"type":"NoSuchEvent","ts":1.0}')
        self.corrupt(log, 3, '{"type":"Tick","ts":"soon"}')
        bad: list = []
        assert [s for s, _, _ in log.read(undecodable=lambda *a: bad.append(a))] == [1, 4]
        assert [(s, subj) for s, subj, _ in bad] == [(2, "ei.default.clock"), (3, "ei.default.clock")]
        assert "NoSuchEvent" in bad[0][2]
        with pytest.raises(CodecError, match="seq=2"):
            list(log.read())

    def test_the_seqs_the_writer_was_not_handed_are_noted(self, tmp_path):
        log = self.make(tmp_path)
        assert log.skipped() == Skipped((), 0)
        log.append(ticks([3, 4, 7]))
        log.append(ticks([4, 7, 8, 12]))  # 4 and 7: redelivered, no hole
        log.append(ticks([13]))
        log = self.reopen(log, tmp_path)
        assert log.skipped() == Skipped(((1, 2), (5, 6), (9, 11)), 0)

    # one contract class per backend runs the same property: differing executors are intended
    @settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors])
    @given(batches=st.lists(st.lists(st.integers(1, 40), max_size=8), max_size=6))
    def test_property_stored_seqs_follow_the_applied_position(self, tmp_path_factory, batches):
        log = self.make(tmp_path_factory.mktemp("prop"))
        applied, expected = 0, []
        for batch in batches:
            new = sorted({s for s in batch if s > applied})
            assert log.append(ticks(batch)) == len(new)
            expected += new
            applied = max([applied, *new])
            assert log.last_seq() == applied
        assert [s for s, _, _ in log.read()] == expected


class TestInMemoryEventLog(EventLogContract):
    def make(self, tmp_path):
        return InMemoryEventLog()

    def reopen(self, log, tmp_path):
        return log

    def corrupt(self, log, seq, payload):
        i = log._seqs.index(seq)
        log._rows[i] = (log._rows[i][0], payload.encode())


class TestDuckDbEventLog(EventLogContract):
    def make(self, tmp_path):
        return DuckDbEventLog(tmp_path / "run.duckdb")

    def reopen(self, log, tmp_path):
        log.close()
        return DuckDbEventLog(tmp_path / "run.duckdb")

    def corrupt(self, log, seq, payload):
        log.con.execute("UPDATE event_rows SET payload = ? WHERE seq = ?", [payload, seq])

    def test_a_nan_ts_written_as_null_before_reads_back_from_its_ts_column(self, tmp_path):
        """Older logs (before such events were refused) hold such a row as ``"ts":null`` (msgspec's JSON) and
        the NaN in the ``ts`` column: it reads back."""
        log = self.make(tmp_path)
        log.append(ticks([1, 2]))
        log.con.execute("""UPDATE event_rows SET payload = '{"type":"Tick","ts":null,"src":"x"}',
                           ts = 'NaN'::DOUBLE WHERE seq = 2""")
        log.close()
        ro = DuckDbEventLog(tmp_path / "run.duckdb", read_only=True)
        (_, _, first), (_, _, second) = ro.read()
        assert first == Tick(ts=1.0) and second.src == "x" and second.ts != second.ts  # NaN
        ro.close()

    def test_a_block_list_the_dictionary_does_not_hold_is_an_undecodable_row(self, tmp_path):
        log = self.make(tmp_path)
        log.append(rows([RequestSubmitted(ts=1.0, request="r", branch="b", blocks=[5, 6]), Tick(ts=2.0)]))
        log.con.execute("UPDATE event_rows SET block_starts = [999] WHERE seq = 1")
        bad: list = []
        assert [s for s, _, _ in log.read(undecodable=lambda *a: bad.append(a))] == [2]
        assert bad[0][0] == 1 and "block list does not decode" in bad[0][2]

    def test_a_log_written_before_skipped_seqs_were_noted(self, tmp_path):
        """Its holes are unknown (``since`` None); reopened for writing, it notes them from then on."""
        log = self.make(tmp_path)
        log.append(ticks([2, 3]))
        log.con.execute("DROP TABLE skipped_seqs")
        log.con.execute("DELETE FROM log_meta WHERE key = 'skipped_since'")
        log.close()
        ro = DuckDbEventLog(tmp_path / "run.duckdb", read_only=True)
        assert ro.skipped() == Skipped((), None)
        ro.close()
        log = DuckDbEventLog(tmp_path / "run.duckdb")
        log.append(ticks([5]))
        assert log.skipped() == Skipped(((4, 4),), 3)

    def test_read_only_open_reads_but_does_not_write(self, tmp_path):
        log = self.make(tmp_path)
        log.append(rows(ONE_OF_EACH))
        log.close()
        ro = DuckDbEventLog(tmp_path / "run.duckdb", read_only=True)
        assert ro.last_seq() == len(ONE_OF_EACH)
        assert len(list(ro.read())) == len(ONE_OF_EACH)
        with pytest.raises(duckdb.Error):
            ro.append(ticks([100]))
        ro.close()

    def test_a_failed_insert_leaves_rows_position_and_block_dictionary_unchanged(self, tmp_path):
        log = self.make(tmp_path)
        assert log.format == "3"
        first = [RequestSubmitted(ts=1.0, request=f"r{i}", branch="b", blocks=[10, 11, 12 + i]) for i in (1, 2)]
        log.append(rows(first))
        bad = [RequestSubmitted(ts=2.0, request="r3", branch="b", blocks=[10, 99, 98]),
               RequestSubmitted(ts=2.0, request="r4", branch="b", blocks=[97], src=None)]  # NOT NULL src
        with pytest.raises(duckdb.ConstraintException):
            log.append([(3, "s", bad[0]), (4, "s", bad[1])])  # the whole batch rolls back, new hashes too
        assert log.last_seq() == 2
        again = RequestSubmitted(ts=3.0, request="r5", branch="b", blocks=[96, 10, 99])
        log.append([(3, "s", again)])
        log = self.reopen(log, tmp_path)
        assert [(s, e) for s, _, e in log.read()] == [(1, first[0]), (2, first[1]), (3, again)]
        (n,) = log.con.execute("SELECT count(*) FROM block_dict").fetchone()
        assert n == 6  # 10, 11, 13, 14, 96, 99: nothing of the failed batch

    def test_an_unknown_format_is_refused_by_name(self, tmp_path):
        log = self.make(tmp_path)
        log.con.execute("UPDATE log_meta SET value = '9' WHERE key = 'format'")
        log.close()
        for read_only in (False, True):
            with pytest.raises(EventLogError, match="event log of format 9; this version reads formats 1, 2, 3"):
                DuckDbEventLog(tmp_path / "run.duckdb", read_only=read_only)


class TestDuckDbEventLogFormat1(EventLogContract):
    """Logs written before format 2 (and the benchmarks' baseline) still read and append."""

    def make(self, tmp_path):
        return DuckDbEventLog(tmp_path / "run.duckdb", format="1")

    def reopen(self, log, tmp_path):
        log.close()
        return DuckDbEventLog(tmp_path / "run.duckdb")  # the file keeps its format

    def corrupt(self, log, seq, payload):
        log.con.execute("UPDATE events SET payload = ? WHERE seq = ?", [payload, seq])

    def test_a_failed_insert_leaves_rows_and_position_unchanged(self, tmp_path):
        log = self.make(tmp_path)
        assert log.format == "1"
        log.append(ticks([1, 2]))
        log.con.execute("INSERT INTO events VALUES (4, 0, 'Tick', '', 'x', '{\"type\":\"Tick\",\"ts\":0.0}')")
        with pytest.raises(duckdb.ConstraintException):
            log.append(ticks([3, 4]))  # 4 collides on the primary key: the whole batch rolls back
        log = self.reopen(log, tmp_path)
        assert log.format == "1" and log.last_seq() == 2
        assert [s for s, _, _ in log.read()] == [1, 2, 4]


def test_duckdb_log_is_safe_to_share_between_threads(tmp_path):
    """run_recorder appends in a worker thread while a service may write run_config in another."""
    import threading

    log = DuckDbEventLog(tmp_path / "run.duckdb")
    errors: list[BaseException] = []

    def appender():
        try:
            for start in range(1, 2001, 50):
                log.append(ticks(range(start, start + 50)))
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    def configurer():
        try:
            for i in range(100):
                log.set_run_config({"round": i})
                log.run_config()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=appender), threading.Thread(target=configurer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert log.last_seq() == 2000 and log.count_by_type() == {"Tick": 2000}
    assert log.run_config() == {"round": 99}
