"""The partition map (services/cores/partitions.py): nodes in blocks, sessions by root, the rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cores.partitions import PartitionError, PartitionMap, block_sizes, partition_names, stable_hash

ROOT = Path(__file__).resolve().parents[3]


def _nodes(n: int) -> list[str]:
    return [f"n{i:03d}" for i in range(n)]


def test_names():
    assert partition_names(1) == ("default",)
    assert partition_names(3) == ("p0", "p1", "p2")
    assert partition_names(2, "eu") == ("eu-0", "eu-1")
    with pytest.raises(PartitionError, match="partitions must be >= 1"):
        partition_names(0)


def test_contiguous_blocks_of_the_paper_scale():
    m = PartitionMap.contiguous(_nodes(768), 8)
    assert [len(ns) for ns in m.nodes] == [96] * 8
    assert m.nodes_of("p0")[0] == "n000" and m.nodes_of("p0")[-1] == "n095"
    assert m.partition_of_node("n096") == "p1" and m.partition_of_node("n767") == "p7"


@given(total=st.integers(1, 400), parts=st.integers(1, 20))
def test_blocks_cover_every_node_once_sizes_within_one(total, parts):
    if parts > total:
        with pytest.raises(PartitionError, match="cannot fill"):
            PartitionMap.contiguous(_nodes(total), parts)
        return
    m = PartitionMap.contiguous(_nodes(total), parts)
    flat = [n for ns in m.nodes for n in ns]
    assert flat == _nodes(total)  # contiguous, in order, each node once
    sizes = [len(ns) for ns in m.nodes]
    assert max(sizes) - min(sizes) <= 1 and sizes == block_sizes(total, parts)
    for i, ns in enumerate(m.nodes):
        assert all(m.node_index(n) == i for n in ns)


@given(roots=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=50), parts=st.integers(1, 12))
def test_sessions_by_root_are_deterministic_and_in_range(roots, parts):
    m = PartitionMap.contiguous(_nodes(parts * 2), parts)
    for r in roots:
        i = m.session_index(r)
        assert 0 <= i < parts
        assert i == m.session_index(r) == stable_hash(r) % parts
        assert m.session_partition(r) == m.names[i]


def test_session_hash_is_the_same_in_another_process():
    """Not Python's salted hash(): a fresh interpreter (another PYTHONHASHSEED) agrees."""
    roots = [f"a{k}:sess-{k}/root" for k in range(50)]
    m = PartitionMap.contiguous(_nodes(16), 8)
    code = ("from services.cores.partitions import PartitionMap\n"
            "m = PartitionMap.contiguous([f'n{i:03d}' for i in range(16)], 8)\n"
            f"print([m.session_index(r) for r in {roots!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=ROOT).stdout
    assert out.strip() == str([m.session_index(r) for r in roots])
    assert len({m.session_index(r) for r in roots}) > 4  # spread, not one partition


def test_sessions_spread_evenly():
    m = PartitionMap.contiguous(_nodes(8), 8)
    counts = [0] * 8
    for k in range(8000):
        counts[m.session_index(f"a{k}")] += 1
    assert min(counts) > 850 and max(counts) < 1150


def test_explicit_and_parse():
    m = PartitionMap.parse("east=n0,n1; west=n2")
    assert m.names == ("east", "west") and m.nodes == (("n0", "n1"), ("n2",))
    assert m == PartitionMap.explicit({"n0": "east", "n1": "east", "n2": "west"})
    with pytest.raises(PartitionError, match="'n1' is in partitions 'a' and 'b'"):
        PartitionMap.parse("a=n0,n1;b=n1")
    with pytest.raises(PartitionError, match="has no node"):
        PartitionMap.explicit({"n0": "a"}, names=["a", "b"])
    with pytest.raises(PartitionError, match="unknown partition 'c'"):
        PartitionMap.explicit({"n0": "c"}, names=["a"])
    with pytest.raises(PartitionError, match="not one subject token"):
        PartitionMap.parse("a.b=n0")
    with pytest.raises(PartitionError, match="bad partition spec"):
        PartitionMap.parse("n0,n1")


def test_cross_partition_rule():
    m = PartitionMap.contiguous(_nodes(4), 2)
    assert m.may_fetch("n000", "n001") and not m.may_fetch("n001", "n002")
    assert m.may_move("p0", "n001") and not m.may_move("p0", "n002")
    with pytest.raises(PartitionError, match="node 'zz' is in no partition"):
        m.may_fetch("zz", "n000")
    with pytest.raises(PartitionError, match="unknown partition 'p9'"):
        m.may_move("p9", "n000")
