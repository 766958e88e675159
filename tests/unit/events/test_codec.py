"""Every event type round-trips; old payloads decode; newer majors are refused."""

from __future__ import annotations

import inspect
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import codec
from events.catalog import EVENT_TYPES, BranchOpened, Candidate, FetchStep, NodeScore, RequestSubmitted, Split
from tests.hyp import examples

u64 = st.integers(min_value=0, max_value=2**64 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
ident = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_/.", min_size=1,
                max_size=12)


def _strategy_for(tp):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is float:
        return finite
    if tp is int:
        return st.integers(min_value=-(2**63), max_value=2**63 - 1)
    if tp is bool:
        return st.booleans()
    if tp is str or getattr(tp, "__supertype__", None) is str:
        return ident
    if getattr(tp, "__supertype__", None) is int:  # BlockHash
        return u64
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of(*[_strategy_for(a) for a in args])
    if tp is type(None):
        return st.none()
    if tp is msgspec.UnsetType:  # a field appended with msgspec.UNSET: absent from the payload
        return st.just(msgspec.UNSET)
    if origin is list:
        return st.lists(_strategy_for(args[0]), max_size=5)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _struct_strategy(tp)
    raise TypeError(f"no strategy for {tp!r}")


def _struct_strategy(cls):
    hints = typing.get_type_hints(cls)
    fields = {f: _strategy_for(hints[f]) for f in cls.__struct_fields__}
    return st.builds(cls, **fields)


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
def test_every_event_round_trips(cls):
    @settings(max_examples=examples(40), deadline=None)
    @given(_struct_strategy(cls))
    def check(ev):
        assert codec.decode(codec.encode(ev)) == ev
        assert codec.from_json(codec.to_json(ev)) == ev
        assert codec.to_builtins(ev)["type"] == cls.__name__

    check()


def test_catalog_is_complete():
    names = {c.__name__ for c in EVENT_TYPES}
    for required in ["BranchOpened", "RequestSubmitted", "ContextCompacted", "BranchEnded", "KvStored",
                     "KvEvicted", "KvMoved", "KvFetched", "NodeRegistered", "NodeHeartbeat", "IterationDone",
                     "RequestStarted", "FirstToken", "RequestFinished", "RouteDecided", "ModelFitted",
                     "PlanEvaluated", "RoleSwitchOrdered", "SwitchRole", "RoleSwitched", "Tick"]:
        assert required in names
    for c in EVENT_TYPES:
        assert c.__struct_config__.frozen, c
        params = inspect.signature(c).parameters.values()
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), c
        assert "ts" in c.__struct_fields__ and "src" in c.__struct_fields__


def test_payload_from_older_version_with_fewer_fields_decodes():
    # An older writer did not know block_tokens/max_tokens: a map without them.
    old = msgspec.msgpack.encode({"type": "RequestSubmitted", "ts": 3.5, "src": "gw-0.9",
                                  "request": "r1", "branch": "b1", "blocks": [7, 8]})
    ev = codec.decode(old)
    assert ev == RequestSubmitted(ts=3.5, src="gw-0.9", request="r1", branch="b1", blocks=[7, 8])
    assert ev.block_tokens == 64 and ev.max_tokens == 0


def test_payload_from_newer_minor_with_extra_fields_decodes():
    newer = msgspec.msgpack.encode({"type": "BranchOpened", "ts": 1.0, "branch": "b", "future_field": [1]})
    assert codec.decode_message(newer, {codec.SCHEMA_HEADER: f"{codec.SCHEMA_MAJOR}.{codec.SCHEMA_MINOR + 3}"}) \
        == BranchOpened(ts=1.0, branch="b")


def test_newer_major_is_refused_clearly():
    data = codec.encode(BranchOpened(ts=1.0, branch="b"))
    with pytest.raises(codec.SchemaVersionError, match=r"schema 2\.0.*understands major 1"):
        codec.decode_message(data, {codec.SCHEMA_HEADER: "2.0"})
    with pytest.raises(codec.SchemaVersionError, match="malformed"):
        codec.decode_message(data, {codec.SCHEMA_HEADER: "x.y"})


@pytest.mark.parametrize("bad", [b"", b"\xc1", msgspec.msgpack.encode({"type": "NoSuchEvent", "ts": 1.0}),
                                 msgspec.msgpack.encode({"type": "Tick"})])
def test_garbage_raises_codec_error(bad):
    with pytest.raises(codec.CodecError):
        codec.decode(bad)


def test_nested_structs_round_trip():
    from events.catalog import PlanEvaluated, RouteDecided

    rd = RouteDecided(ts=1.0, request="r", prefill_node="n1", decode_node="n2",
                      fetch_plan=[FetchStep(src_node="n3", first_block=0, n_blocks=4)],
                      scores=[NodeScore(node="n1", score=0.5)])
    pe = PlanEvaluated(ts=2.0, window_start=0.0, window_end=600.0, current=Split(prefill=6, decode=3),
                       candidates=[Candidate(split=Split(prefill=4, decode=5), mean_gain=1.0, se=0.1)],
                       chosen=Split(prefill=4, decode=5))
    for ev in (rd, pe):
        assert codec.decode(codec.encode(ev)) == ev
