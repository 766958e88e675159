"""Chained block hashing: token ids -> 64-bit block hashes, stable across processes.

A prompt is cut into blocks of ``block_tokens`` tokens (default 64). The hash of block ``i``
covers the hash of block ``i-1`` (its parent) and its own tokens, so equal hashes mean equal
prefixes (as in vLLM and Dynamo). The partial last block is not hashed: it cannot be reused.

BLAKE2b with an 8-byte digest over ``parent (u64 LE) || tokens (u32 LE)`` is used instead of
Python's ``hash`` (salted per process) or a random seed (differs per run): the same tokens give
the same hashes on every machine, which replays and a multi-process directory depend on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from events.ids import BlockHash

DEFAULT_BLOCK_TOKENS = 64
#: Parent of the first block. A namespace (e.g. a model or a tenant) can replace it.
ROOT_PARENT = 0
_MASK = (1 << 64) - 1


def hash_block_tokens(parent: int, tokens: Sequence[int] | np.ndarray) -> BlockHash:
    """Hash one block: its parent's hash and its token ids."""
    arr = np.asarray(tokens, dtype="<u4")
    h = hashlib.blake2b(digest_size=8)
    h.update((parent & _MASK).to_bytes(8, "little"))
    h.update(arr.tobytes())
    return BlockHash(int.from_bytes(h.digest(), "little"))


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    root: int = ROOT_PARENT,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``tokens``; a partial tail is not hashed."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    arr = np.asarray(tokens, dtype="<u4")
    n_full = len(arr) // block_tokens
    out: list[BlockHash] = []
    parent = root
    for i in range(n_full):
        parent = hash_block_tokens(parent, arr[i * block_tokens : (i + 1) * block_tokens])
        out.append(parent)
    return out


def namespace_root(namespace: str) -> int:
    """A root parent derived from a namespace string (model, tenant, trace file)."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def namespaced_hash(namespace: str, local_id: int) -> BlockHash:
    """Map a trace-local block id (e.g. kv-cache-tester or Mooncake ``hash_ids``) to a global
    64-bit hash, so ids of two traces with ``hash_id_scope: local`` never collide."""
    h = hashlib.blake2b(digest_size=8, key=namespace.encode()[:64])
    h.update(int(local_id).to_bytes(8, "little", signed=True))
    return BlockHash(int.from_bytes(h.digest(), "little"))
