"""KvLayout sizes, fingerprints, slot checks and run coalescing (pure Python, no torch)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels.layout import KvLayout, KvLayoutError, check_slots, coalesce_runs


def test_block_bytes_counts_every_element_at_its_width():
    assert KvLayout(64, 122, 8, 128, "bf16").block_bytes == 64 * 122 * 8 * 128 * 2
    assert KvLayout(64, 61, 1, 576, "fp8_e4m3").block_bytes == 64 * 61 * 576


def test_fingerprint_round_trips():
    layout = KvLayout(16, 4, 2, 64, "fp8_e5m2")
    assert layout.fingerprint() == "fp8_e5m2:16x4x2x64"
    assert KvLayout.from_fingerprint(layout.fingerprint()) == layout


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"block_tokens": 0, "layers": 1, "heads": 1, "head_dim": 1}, "block_tokens"),
        ({"block_tokens": 1, "layers": 1, "heads": 1, "head_dim": 1, "dtype": "int4"}, "dtype"),
    ],
)
def test_bad_layout_names_the_field(kwargs, msg):
    with pytest.raises(KvLayoutError, match=msg):
        KvLayout(**kwargs)


def test_bad_fingerprint_is_one_clear_line():
    with pytest.raises(KvLayoutError, match="fingerprint"):
        KvLayout.from_fingerprint("bf16-64-1")


def test_check_slots_names_the_bad_slot():
    with pytest.raises(KvLayoutError, match="slot 9 is outside 0..7"):
        check_slots([1, 9], 8, "gather", unique=False)
    with pytest.raises(KvLayoutError, match="slot 3 is written twice"):
        check_slots([3, 1, 3], 8, "scatter", unique=True)
    check_slots([3, 3], 8, "gather", unique=False)


def test_coalesce_runs_exact():
    assert coalesce_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 7]) == [(4, 0, 3), (9, 3, 2), (2, 7, 1)]
    assert coalesce_runs([], []) == []
    with pytest.raises(KvLayoutError, match="differ in length"):
        coalesce_runs([1], [])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_coalesce_runs_expand_to_the_pairs_and_are_maximal(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = coalesce_runs(src, dst)
    expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert expanded == pairs
    for (s0, d0, n0), (s1, d1, _) in itertools.pairwise(runs):
        assert not (s1 == s0 + n0 and d1 == d0 + n0), "two adjacent runs could have been one"
