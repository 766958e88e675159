"""A prompt's chained block hashes, reusing the blocks it shares with the previous prompt of its
branch (the gateway's step 3, app.py).

An agent's turn resends the whole conversation: the next prompt of a branch is the previous one
plus the new messages, so all but its last few blocks hash as before. :class:`PrefixHashes`
keeps, per branch, the last prompt's token ids and hashes; a new prompt is compared with them
(one vectorised comparison, ~0.02 ms per 100K tokens), the hashes of the full blocks before
the first differing token are taken as they are, and only the rest is hashed
(``events.hashing.block_hashes`` from the last reused hash). The result is the same list
``block_hashes(ids, block_tokens)`` returns, whatever the prompts (tests/unit/drivers/gateway/
test_prefix_hashes.py): a prompt that diverges anywhere gets the hashes of what it holds.

The token ids become a uint32 array through ``array.array`` (0.6 ms per 100K ids against
numpy's 2.6 ms for a list of Python ints). Memory: the kept prompts are bounded by
``max_tokens`` in all (4 bytes a token), the least recently used branch dropped first; a branch
not kept is hashed whole.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from events.hashing import ROOT_PARENT, block_hashes
from events.ids import BlockHash


def as_u32(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a little-endian uint32 array (an id outside 0 .. 2**32 - 1 raises
    ``OverflowError``, as numpy's conversion does)."""
    if isinstance(ids, np.ndarray):
        return np.asarray(ids, dtype="<u4")
    return np.frombuffer(array.array("I", ids), dtype=np.uint32).astype("<u4", copy=False)


class PrefixHashes:
    """Per-branch memory of the last prompt's ids and hashes (module docstring). An ended
    branch is not dropped at once: its request ids never come back, and the bound drops it."""

    def __init__(self, block_tokens: int, max_tokens: int = 8_000_000) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens, self.max_tokens = block_tokens, max_tokens
        self._last: OrderedDict[str, tuple[np.ndarray, tuple[BlockHash, ...]]] = OrderedDict()
        self._held = 0  # tokens kept in all
        self.reused_blocks = self.hashed_blocks = 0  # counters (metrics, tests)

    def hashes(self, branch: str, ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
        """``block_hashes(ids, block_tokens)``, reusing the branch's previous prompt's prefix."""
        bt = self.block_tokens
        arr = as_u32(ids)
        prev = self._last.pop(branch, None)
        reuse = 0
        if prev is not None:
            parr, phashes = prev
            self._held -= len(parr)
            m = min(len(arr), len(parr)) // bt * bt
            diff = np.flatnonzero(arr[:m] != parr[:m])
            first = int(diff[0]) if len(diff) else m
            reuse = min(first // bt, len(phashes))
            out = list(phashes[:reuse])
        else:
            out = []
        root = out[-1] if reuse else ROOT_PARENT
        fresh = block_hashes(arr[reuse * bt:], bt, root=root)
        out = out + fresh
        self.reused_blocks += reuse
        self.hashed_blocks += len(fresh)
        if len(arr) <= self.max_tokens:
            self._last[branch] = (arr, tuple(out))  # the caller owns the list it gets
            self._held += len(arr)
            while self._held > self.max_tokens:
                _, (old, _h) = self._last.popitem(last=False)
                self._held -= len(old)
        return out

    def __len__(self) -> int:
        return len(self._last)
