"""Block hashing is chained, deterministic and stable across processes."""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import block_hashes, hash_block_tokens, namespace_root, namespaced_hash
from tests.hyp import examples

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=400)


def test_same_tokens_same_hashes_in_another_process():
    toks = list(range(1000, 1000 + 64 * 5 + 17))
    here = block_hashes(toks)
    code = ("import json,sys; from events.hashing import block_hashes; "
            "print(json.dumps(block_hashes(json.loads(sys.stdin.read()))))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(toks), capture_output=True,
                         text=True, check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""})
    assert json.loads(out.stdout) == here
    assert len(here) == 5


@settings(max_examples=examples(60), deadline=None)
@given(tokens_st, st.integers(min_value=1, max_value=64))
def test_partial_tail_not_hashed_and_prefix_property(toks, bt):
    hs = block_hashes(toks, bt)
    assert len(hs) == len(toks) // bt
    # a prefix of the tokens has a prefix of the hashes
    cut = len(toks) // 2
    assert block_hashes(toks[:cut], bt) == hs[: cut // bt]
    assert all(0 <= h < 2**64 for h in hs)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50_000), min_size=64 * 4, max_size=64 * 6),
       st.integers(min_value=0, max_value=64 * 4 - 1), st.integers(min_value=1, max_value=1000))
def test_changing_one_token_changes_that_block_and_every_later_one(toks, pos, delta):
    hs = block_hashes(toks)
    changed = list(toks)
    changed[pos] = (changed[pos] + delta) % 2**32
    hs2 = block_hashes(changed)
    b = pos // 64
    assert hs2[:b] == hs[:b]
    assert all(x != y for x, y in zip(hs[b:], hs2[b:]))


def test_parent_is_part_of_the_hash():
    blk = list(range(64))
    assert hash_block_tokens(0, blk) != hash_block_tokens(1, blk)
    assert block_hashes(blk, root=namespace_root("a")) != block_hashes(blk, root=namespace_root("b"))


def test_namespaced_ids_are_distinct_per_namespace_and_stable():
    assert namespaced_hash("s1", 5) == namespaced_hash("s1", 5)
    assert namespaced_hash("s1", 5) != namespaced_hash("s2", 5)
    assert len({namespaced_hash("s1", i) for i in range(10_000)}) == 10_000
