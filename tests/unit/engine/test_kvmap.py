"""SGLang page hashes -> our block hashes (engine/backends/kvmap.py): exact blocks for
page sizes below, equal to and above our block size; removal, clearing, tiers, orphans."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends.kvmap import PageMap
from engine.backends.sglang.wire import (
    SGLANG_TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from events.hashing import block_hashes
from tests.hyp import examples

TOKENS = list(range(1000, 1000 + 64 * 3 + 10))  # 3 full blocks + a 10-token tail


def pages(tokens, page_size, medium="GPU", first_hash=100):
    """One BlockStored per page, chained by parent hash, as SGLang's radix cache publishes them."""
    evs, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = first_hash + i
        evs.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=tokens[i:i + page_size],
                               block_size=page_size, lora_id=None, medium=medium))
        parent = h
    return evs


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_our_hashes_come_out_for_any_page_size(page_size):
    m = PageMap(64, tiers=SGLANG_TIERS)
    changes = m.apply(KVEventBatch(ts=0.0, events=pages(TOKENS, page_size)))
    stored = [b for c in changes for b in c.blocks]
    want = block_hashes(TOKENS, 64)
    if page_size == 128:  # the third block sits in a page SGLang has not filled (tail < 128)
        want = want[:2]
    assert stored == want and {c.tier for c in changes} == {"L1"}


def test_removal_reports_the_blocks_the_removed_pages_completed():
    m = PageMap(64, tiers=SGLANG_TIERS)
    m.apply(KVEventBatch(ts=0.0, events=pages(TOKENS, 16)))
    want = block_hashes(TOKENS, 64)
    # leaf-first: the pages 8..11 (tokens 128..191) hold the third block's end
    ch = m.apply(KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[100 + 16 * k for k in range(8, 12)])]))
    assert [(c.kind, c.tier, c.blocks) for c in ch] == [("evicted", "L1", [want[2]])]
    ch = m.apply(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
    assert [c.kind for c in ch] == ["cleared"] and m.pages == {}


def test_host_tier_and_unknown_media_and_orphans():
    m = PageMap(64, tiers=SGLANG_TIERS)
    ch = m.apply(KVEventBatch(ts=0.0, events=pages(TOKENS[:64], 64, medium="CPU_PINNED")))
    assert [(c.tier, c.blocks) for c in ch] == [("L2", block_hashes(TOKENS[:64]))]
    # the same page reaching the GPU too is a new L1 copy
    ch = m.apply(KVEventBatch(ts=0.0, events=pages(TOKENS[:64], 64, medium="GPU")))
    assert [(c.tier, c.blocks) for c in ch] == [("L1", block_hashes(TOKENS[:64]))]
    assert m.apply(KVEventBatch(ts=0.0, events=pages(TOKENS[:64], 64, medium="DISK"))) == []
    orphan = BlockStored(block_hashes=[5], parent_block_hash=999, token_ids=TOKENS[:64], block_size=64, lora_id=None)
    assert m.apply(KVEventBatch(ts=0.0, events=[orphan])) == []
    assert m.errors == {"medium_DISK": 1, "orphan_pages": 1}


def test_aliases_map_sent_tokens_to_the_requests_blocks():
    m = PageMap(64, tiers=SGLANG_TIERS)
    sent = block_hashes(TOKENS[:128])
    m.alias(sent[0], 11)
    m.alias(sent[1], 22)
    ch = m.apply(KVEventBatch(ts=0.0, events=pages(TOKENS[:128], 32)))
    assert [b for c in ch for b in c.blocks] == [11, 22]


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=0, max_size=400), st.sampled_from([1, 4, 16, 64, 256]))
def test_stored_then_removed_leaves_nothing(tokens, page_size):
    m = PageMap(64, tiers=SGLANG_TIERS)
    evs = pages(tokens, page_size)
    stored = [b for c in m.apply(KVEventBatch(ts=0.0, events=evs)) for b in c.blocks]
    assert stored == block_hashes(tokens[: len(tokens) - len(tokens) % page_size], 64)
    gone = m.apply(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[e.block_hashes[0] for e in reversed(evs)])]))
    assert sorted(b for c in gone for b in c.blocks) == sorted(stored) and m.pages == {}
