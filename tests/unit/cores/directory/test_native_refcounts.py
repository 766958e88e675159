"""The compiled kernels hold no reference to the block lists they are given (a soak found every
process with a directory growing ~3.7 MB/min: ``PySequence_Fast``'s new reference was never
released, so every request's block list stayed alive)."""

from __future__ import annotations

import sys

import pytest
from services.cores.directory._native import SlotMap

from engine import _kvscan
from services.cores.directory import _native

CALLS = {
    "SlotMap.find_seq": lambda b: SlotMap(64).find_seq(b),
    "fresh": lambda b: _native.fresh(b, set(), set()),
    "dropped": lambda b: _native.dropped(b, set(), set(), set()),
    "prefix_len": lambda b: _kvscan.prefix_len(b, 0, set(b[:3])),
    "missing_after": lambda b: _kvscan.missing_after(b, 0, set(b[:3])),
    "held_unpinned": lambda b: _kvscan.held_unpinned(b, set(b), set()),
    "held_unpinned (BlockCounts)": lambda b: _kvscan.held_unpinned(b, set(b), _native.BlockCounts()),
    "common_prefix": lambda b: _kvscan.common_prefix(b, b),
    "BlockCounts.add/remove": lambda b: _native.BlockCounts().add(b) or None,
    "BlockCounts.add+remove": lambda b: _added(b).remove(b),
    "prefix_len (BlockSet)": lambda b: _kvscan.prefix_len(b, 0, _tier(b[:3])),
    "missing_after (BlockSet)": lambda b: _kvscan.missing_after(b, 0, _tier(b[:3])),
    "held_unpinned (BlockSet, BlockCounts)": lambda b: _kvscan.held_unpinned(b, _tier(b), _added(b[:3])),
    "BlockSet.update+difference_update": lambda b: _tier(b).difference_update(b),
}


def _tier(b):
    s = _native.BlockSet()
    s.update(b)
    return s


def _added(b):
    c = _native.BlockCounts()
    c.add(b)
    return c


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("kind", [list, tuple])
def test_a_kernel_leaves_its_input_as_it_found_it(name, kind):
    blocks = kind(range(1 << 40, (1 << 40) + 50))
    before = sys.getrefcount(blocks)
    for _ in range(100):
        CALLS[name](blocks)
    assert sys.getrefcount(blocks) == before, f"{name} keeps a reference to its {kind.__name__} each call"
