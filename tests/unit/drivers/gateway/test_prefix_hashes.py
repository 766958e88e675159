"""PrefixHashes gives exactly block_hashes' list, whatever a branch's prompts share."""

from __future__ import annotations

import numpy as np
import pytest

from events.hashing import block_hashes
from services.drivers.gateway.prefix_hashes import PrefixHashes, as_u32


def _turns(seed: int, n: int = 12) -> list[list[int]]:
    """A branch's prompts: mostly the previous one plus new tokens, sometimes cut (compaction),
    edited in the middle, shorter than a block, or replaced."""
    rng = np.random.default_rng(seed)
    p: list[int] = rng.integers(0, 49_152, int(rng.integers(1, 400))).tolist()
    out = [p]
    for _ in range(n):
        kind = rng.integers(0, 5)
        if kind <= 1:
            p = p + rng.integers(0, 49_152, int(rng.integers(0, 300))).tolist()
        elif kind == 2 and p:
            p = p[: int(rng.integers(0, len(p) + 1))]
        elif kind == 3 and p:
            p = list(p)
            p[int(rng.integers(0, len(p)))] ^= 1  # one token changed somewhere
        else:
            p = rng.integers(0, 49_152, int(rng.integers(0, 500))).tolist()
        out.append(p)
    return out


@pytest.mark.parametrize("block_tokens", [1, 16, 64])
@pytest.mark.parametrize("seed", range(12))
def test_same_hashes_as_block_hashes(seed: int, block_tokens: int) -> None:
    ph = PrefixHashes(block_tokens)
    for ids in _turns(seed):
        assert ph.hashes("b", ids) == block_hashes(ids, block_tokens)
    assert ph.reused_blocks > 0  # the case the class is for happened in every sequence


def test_a_continued_prompt_hashes_only_its_new_blocks() -> None:
    ph = PrefixHashes(64)
    first = list(range(640))
    ph.hashes("s", first)
    assert (ph.reused_blocks, ph.hashed_blocks) == (0, 10)
    ph.hashes("s", first + list(range(1000, 1130)))  # 770 tokens: 12 blocks, 10 of them reused
    assert (ph.reused_blocks, ph.hashed_blocks) == (10, 12)
    ph.hashes("t", first)  # another branch: nothing of "s" is reused
    assert (ph.reused_blocks, ph.hashed_blocks) == (10, 22)


def test_a_change_in_the_middle_rehashes_from_its_block() -> None:
    ph = PrefixHashes(64)
    ids = list(range(640))
    ph.hashes("s", ids)
    edited = list(ids)
    edited[200] = 7  # block 3
    assert ph.hashes("s", edited) == block_hashes(edited, 64)
    assert ph.reused_blocks == 3


def test_the_memory_bound_drops_the_least_recent_branch() -> None:
    ph = PrefixHashes(64, max_tokens=1000)
    ph.hashes("a", list(range(600)))
    ph.hashes("b", list(range(300)))
    ph.hashes("a", list(range(600)))  # a is now the most recent: reused, kept
    assert ph.reused_blocks == 9
    ph.hashes("c", list(range(300)))  # 1,200 tokens: b, the least recent, goes
    assert len(ph) == 2
    ph.hashes("b", list(range(300)))
    assert ph.reused_blocks == 9  # b was dropped: hashed whole
    ph.hashes("big", list(range(5000)))  # larger than the bound: hashed, not kept
    assert "big" not in ph._last


def test_as_u32_matches_numpy_and_refuses_what_numpy_refuses() -> None:
    ids = [0, 1, 49_151, 2**32 - 1]
    assert as_u32(ids).tobytes() == np.asarray(ids, dtype="<u4").tobytes()
    with pytest.raises(OverflowError):
        as_u32([2**32])
    with pytest.raises(OverflowError):
        as_u32([-1])
