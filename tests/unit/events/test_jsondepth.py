"""events.jsondepth: the nesting depth of JSON text, read from its bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.jsondepth import nesting_depth, too_deep
from tests.hyp import examples


def reference(raw: bytes) -> int:
    """The same rule byte by byte: a backslash escapes the byte after it, an unescaped quote
    opens or closes a string, brackets outside strings step the level."""
    level = deepest = 0
    in_string = escaped = False
    for c in raw:
        if escaped:
            escaped = False
        elif c == ord("\\"):
            escaped = True
        elif c == ord('"'):
            in_string = not in_string
        elif not in_string and c in b"[{":
            level += 1
            deepest = max(deepest, level)
        elif not in_string and c in b"]}":
            level -= 1
    return deepest


def depth_of(obj) -> int:
    if isinstance(obj, list):
        return 1 + max((depth_of(x) for x in obj), default=0)
    if isinstance(obj, dict):
        return 1 + max((depth_of(x) for x in obj.values()), default=0)
    return 0


@pytest.mark.parametrize(("text", "depth"), [
    (b"", 0), (b"1", 0), (b'"[[["', 0), (b"[]", 1), (b"{}", 1), (b'{"a": 1}', 1), (b'{"a": [1]}', 2),
    (b'[[], [[]], []]', 3), (b'{"a": "]]]]", "b": [[1]]}', 3),  # brackets in strings do not count
    (b'["\\"[[["]', 1),  # an escaped quote does not end the string
    (b'["\\\\", [[1]]]', 3),  # an escaped backslash does not escape the quote after it
    (b'["\\\\\\"[", [1]]', 2),  # three backslashes: the quote is escaped
    ('{"é": [["ü"]]}', 3),  # str is read as UTF-8
    (b"[" * 990 + b"]" * 990, 990), (b"[{" * 50_000 + b"}]" * 50_000, 100_000),
])
def test_depth_table(text, depth):
    assert nesting_depth(text) == depth


def test_too_deep_names_the_depth_only_over_the_limit():
    assert too_deep(b"[" * 128 + b"]" * 128, 128) is None
    assert too_deep(b"[" * 129 + b"]" * 129, 128) == 129
    assert too_deep(b'["' + b"[" * 1000 + b'"]', 128) is None  # in a string: no nesting at all
    assert too_deep(b"[]" * 10_000, 128) is None  # many brackets, shallow


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text('"\\[]{}ab', max_size=6),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text('"\\[]{k', max_size=4),
                                                                               kids, max_size=3),
                     max_leaves=30)


@settings(max_examples=examples(300), derandomize=True, database=None)
@given(obj=_JSON, chunk=st.sampled_from([1, 2, 3, 7, 1 << 20]))
def test_depth_of_any_document_at_any_chunk_size(obj, chunk):
    assert nesting_depth(json.dumps(obj).encode(), chunk) == depth_of(obj)


@settings(max_examples=examples(500), derandomize=True, database=None)
@given(raw=st.binary(max_size=48).map(lambda b: bytes(b'[]{}"\\a'[x % 7] for x in b)),
       chunk=st.sampled_from([1, 2, 3, 5, 1 << 20]))
def test_malformed_text_follows_the_byte_rule(raw, chunk):
    """Any bytes (escapes and strings across chunk boundaries too): the byte-by-byte rule."""
    assert nesting_depth(raw, chunk) == reference(raw)
