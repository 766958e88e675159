"""Random small JSON Schemas (a hypothesis strategy) for the structured-output property tests:
objects, arrays, strings, numbers, enums, consts, anyOf, nested a few deep - the shapes of tool
parameters. Strings and arrays are bounded (``maxLength``, ``maxItems``), so an output whose
tokens are drawn at random under a grammar's mask still ends within a small budget."""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = st.sampled_from(["a", "b", "city", "n", "path", "x_y", "days"])

_leaf = st.one_of(
    st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": lo + hi},
              st.integers(0, 3), st.integers(0, 5)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "integer"}).map(lambda s: {**s, "minimum": 0, "maximum": 999}),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", "x"]), min_size=1, max_size=3, unique=True)
    .map(lambda v: {"enum": v}),
    st.sampled_from(["fixed", 3, True]).map(lambda v: {"const": v}),
    st.builds(lambda n: {"type": "string", "format": "date", "maxLength": 10 + n}, st.integers(0, 2)),
)


def _extend(children):
    obj = st.builds(
        lambda props, req_mask: {"type": "object", "additionalProperties": False,
                                 "properties": props,
                                 "required": [k for k, r in zip(props, req_mask, strict=False) if r]},
        st.dictionaries(NAMES, children, min_size=1, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3))
    arr = st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                    children, st.integers(0, 2), st.integers(0, 2))
    any_of = st.lists(children, min_size=2, max_size=2).map(lambda bs: {"anyOf": bs})
    return st.one_of(obj, arr, any_of)


#: a schema a few levels deep whose top is an object (as tool parameters and most JSON answers are)
schemas = st.recursive(_leaf, _extend, max_leaves=6).map(
    lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"],
                                                   "additionalProperties": False})
