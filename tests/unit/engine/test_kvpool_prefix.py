"""KvPool.prefix_len (chunked ``issuperset`` scan) equals its definition: the end of the run of
``blocks[start:]`` held in the store, walked block by block."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine import kvpool
from engine.kvpool import KvPool


def _walk(blocks, start, store) -> int:
    i = start
    while i < len(blocks) and blocks[i] in store:
        i += 1
    return max(i, start)


@given(blocks=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 30), max_size=3 * kvpool._PREFIX_CHUNK + 5),
       held=st.data(), start=st.integers(0, 3 * kvpool._PREFIX_CHUNK + 10))
def test_prefix_len_is_the_held_run(blocks, held, start):
    store = set(held.draw(st.lists(st.sampled_from(blocks), unique=True))) if blocks else set()
    store |= set(held.draw(st.lists(st.integers(0, 30), max_size=5)))
    assert KvPool.prefix_len(blocks, start, store) == _walk(blocks, start, store)


def test_prefix_len_at_chunk_boundaries():
    c = kvpool._PREFIX_CHUNK
    blocks = list(range(3 * c))
    for k in (0, 1, c - 1, c, c + 1, 2 * c, 3 * c - 1, 3 * c):
        store = set(blocks[:k])
        for start in (0, 1, c - 1, c, k, 3 * c):
            assert KvPool.prefix_len(blocks, start, store) == _walk(blocks, start, store), (k, start)
    assert KvPool.prefix_len(blocks, 0, set(blocks)) == 3 * c
    assert KvPool.prefix_len((5, 6, 7), 1, {6}) == 2  # any sequence, not only lists
