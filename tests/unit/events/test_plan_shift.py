"""Schema 1.5: ``PlanEvaluated.shift`` (issue 41 part 1) - absent unless set, so a window-end
decision's payload is byte-identical to a 1.4 one, and a 1.4 reader ignores the field."""

from __future__ import annotations

import msgspec

from events import codec
from events.catalog import Candidate, PlanEvaluated, ShiftTest, Split


class PlanEvaluated14(msgspec.Struct, kw_only=True, tag_field="type", tag="PlanEvaluated"):
    """What a 1.4 reader knew of the event."""

    ts: float
    src: str = ""
    window_start: float
    window_end: float
    current: Split
    candidates: list[Candidate] = []
    chosen: Split | None = None
    reason: str = ""
    planner: str = ""


def _plan(**kw) -> PlanEvaluated:
    return PlanEvaluated(ts=1740.9, src="evolving", window_start=1560.0, window_end=1740.0,
                         current=Split(prefill=4, decode=5), chosen=Split(prefill=8, decode=1),
                         reason="shift (...): mean gain 8.1 req/s > 2 SE (0.151)", planner="evolving", **kw)


def test_a_window_end_decision_is_byte_identical_to_14():
    ev = _plan()
    assert b"\xa5shift" not in codec.encode(ev) and b'"shift"' not in codec.to_json(ev)
    old = PlanEvaluated14(ts=ev.ts, src=ev.src, window_start=ev.window_start, window_end=ev.window_end,
                          current=ev.current, chosen=ev.chosen, reason=ev.reason, planner=ev.planner)
    assert codec.encode(ev) == msgspec.msgpack.encode(old)


def test_the_shift_test_round_trips_and_a_14_reader_ignores_it():
    t = ShiftTest(signal="gain 8P", recent=6.63, older=-7.34, se=0.048, n_recent=3, n_older=7)
    ev = _plan(shift=t)
    data = codec.encode(ev)
    assert codec.decode_message(data, codec.headers()) == ev
    assert codec.from_json(codec.to_json(ev)).shift == t
    assert codec.headers() == {codec.SCHEMA_HEADER: "1.6"}
    old = msgspec.msgpack.decode(data, type=PlanEvaluated14)
    assert (old.reason, old.chosen) == (ev.reason, ev.chosen)
