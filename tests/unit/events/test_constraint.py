"""Schema 1.4: ``RequestSubmitted.constraint`` (issue 36) - absent unless set, so a payload
without it is byte-identical to a 1.3 one, and a 1.3 reader ignores it."""

from __future__ import annotations

import msgspec

from events import codec
from events.catalog import OutputConstraint, RequestSubmitted


class RequestSubmitted13(msgspec.Struct, kw_only=True, tag_field="type", tag="RequestSubmitted"):
    """What a 1.3 reader knew of the event (the fields that matter here)."""

    ts: float
    request: str
    branch: str
    max_tokens: int = 0
    stop: list[str] | msgspec.UnsetType = msgspec.UNSET


def test_absent_constraint_is_not_in_the_payload():
    ev = RequestSubmitted(ts=1.0, request="r", branch="b", max_tokens=8, stop=["x"])
    assert b"constraint" not in codec.encode(ev) and b"constraint" not in codec.to_json(ev)


def test_constraint_round_trips_and_a_13_reader_ignores_it():
    c = OutputConstraint(json_schema='{"type":"object"}', prefix="<tool_call>\n", suffix="\n</tool_call>")
    ev = RequestSubmitted(ts=1.0, request="r", branch="b", max_tokens=8, constraint=c)
    data = codec.encode(ev)
    assert codec.decode_message(data, codec.headers()) == ev
    assert codec.from_json(codec.to_json(ev)).constraint == c
    assert codec.SCHEMA_MAJOR == 1 and codec.SCHEMA_MINOR >= 4  # 1.4 added it (1.5: PlanEvaluated.shift)
    old = msgspec.msgpack.decode(data, type=RequestSubmitted13)
    assert (old.request, old.max_tokens, old.stop) == ("r", 8, msgspec.UNSET)


def test_the_worker_hands_the_constraint_to_the_engine():
    from engine.backend import Sampling, request_output

    c = OutputConstraint(json_schema='{"type":"object"}')
    assert request_output(RequestSubmitted(ts=1.0, request="r", branch="b", constraint=c))["sampling"] == \
        Sampling(constraint=c)  # greedy otherwise, as a request without sampling parameters
    assert request_output(RequestSubmitted(ts=1.0, request="r", branch="b"))["sampling"] is None
