"""An engine's page hashes -> our block hashes: a pure translator of KV events (no I/O).

Shared by the SGLang and vLLM backends: both publish the same three events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) with their own media names, so each passes its own
``tiers`` table (engine/backends/sglang/wire.py ``SGLANG_TIERS``, engine/backends/vllm/backend.py
``VLLM_TIERS``) and neither backend imports the other.

The mapping (docs/engines.md)
- SGLang hashes *pages* of ``page_size`` tokens (``--page-size``; 1 by default, 64 here) with
  its own SHA-256 chain, published as signed int64 (``BlockStored.block_hashes``). We hash
  *blocks* of ``block_tokens`` (64) tokens with BLAKE2b (events/hashing.py). The two cannot be
  converted into each other, so the translator recomputes ours from what the event carries:
  ``BlockStored.token_ids`` and the parent link ``parent_block_hash``.
- Per SGLang page it keeps the chain state after that page: our parent hash and the tokens
  not yet making a full block. A page's tokens are appended to its parent page's state; every
  64 tokens close one of our blocks, ``hash_block_tokens(parent, tokens)``, attributed to the
  page that completed it. Works for any ``page_size`` (1, 16, 64, 128...).
- ``aliases``: when the backend sent token ids it made up for a request (the bus carries block
  hashes, not the prompt), it registers hash-of-sent-block -> the request's block hash, and the
  translator reports the alias. With the real prompt's tokens the two are the same number.
- ``BlockRemoved``: our blocks completed by the removed pages are gone from that tier.
  SGLang evicts leaf-first, so a block is never left half-held. ``AllBlocksCleared``: both
  tiers are empty (SGLang sends it on a cache flush and on a role switch).
- ``medium``: the backend's ``tiers`` table maps it (SGLang: ``GPU`` or absent -> L1,
  ``CPU_PINNED`` (HiCache host) -> L2; vLLM: ``CPU`` -> L2); a medium the table lacks (SGLang's
  ``DISK`` and ``EXTERNAL``) is not a tier of ours and is skipped (counted). Events are told
  apart by class name, so each engine's own wire structs drive the same map, and page hashes
  may be ``bytes`` as well as ints.
- A page whose parent page is unknown (events lost, or published before we subscribed) is
  skipped and counted (``orphan_pages``), never fatal, as Dynamo's indexer does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from events.hashing import ROOT_PARENT, hash_block_tokens
from events.ids import BlockHash, Tier


@dataclass(slots=True)
class _Page:
    parent: int  # our chained hash after this page (raw: before aliasing)
    pending: tuple[int, ...]  # tokens after the last full block
    blocks: list[BlockHash] = field(default_factory=list)  # our blocks this page completed
    tiers: set = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Change:
    kind: str  # "stored" | "evicted" | "cleared"
    tier: Tier | None
    blocks: list[BlockHash]


class PageMap:
    """Translate an engine's KV events into our block facts (module docstring)."""

    def __init__(self, block_tokens: int, *, tiers: Mapping[str | None, Tier], root: int = ROOT_PARENT) -> None:
        self.bt = block_tokens
        self.root = root
        self.tiers = tiers
        self.pages: dict[int | bytes, _Page] = {}
        self.aliases: dict[int, BlockHash] = {}
        self.errors: Counter[str] = Counter()

    def alias(self, sent_hash: int, block: BlockHash) -> None:
        if sent_hash != block:
            self.aliases[sent_hash] = block

    def apply(self, batch: Any) -> list[Change]:
        """``batch``: an engine's ``KVEventBatch`` (its ``events``: BlockStored, BlockRemoved,
        AllBlocksCleared of that engine's wire module)."""
        out: list[Change] = []
        for ev in batch.events:
            kind = type(ev).__name__  # SGLang's or vLLM's structs (module docstring)
            if kind == "BlockStored":
                self._stored(ev, out)
            elif kind == "BlockRemoved":
                self._removed(ev, out)
            elif kind == "AllBlocksCleared":
                self.pages.clear()
                out.append(Change("cleared", None, []))
        return out

    def _tier(self, medium: str | None) -> Tier | None:
        tier = self.tiers.get(medium)
        if tier is None:
            self.errors[f"medium_{medium}"] += 1
        return tier

    def _stored(self, ev: Any, out: list[Change]) -> None:
        tier = self._tier(ev.medium)
        if tier is None:
            return
        if ev.parent_block_hash is None:
            parent, pending = self.root, ()
        else:
            pp = self.pages.get(ev.parent_block_hash)
            if pp is None:
                self.errors["orphan_pages"] += len(ev.block_hashes)
                return
            parent, pending = pp.parent, pp.pending
        n = len(ev.block_hashes)
        size = ev.block_size if n == 1 else max(1, len(ev.token_ids) // max(1, n))
        new: list[BlockHash] = []
        for i, h in enumerate(ev.block_hashes):
            page = self.pages.get(h)
            toks = ev.token_ids[i * size:(i + 1) * size]
            if page is None:
                tokens = pending + tuple(toks)
                done: list[BlockHash] = []
                while len(tokens) >= self.bt:
                    parent = hash_block_tokens(parent, tokens[: self.bt])
                    done.append(self.aliases.get(parent, parent))
                    tokens = tokens[self.bt:]
                page = _Page(parent, tokens, done)
                self.pages[h] = page
            if tier not in page.tiers:
                page.tiers.add(tier)
                new.extend(page.blocks)
            parent, pending = page.parent, page.pending
        if new:
            out.append(Change("stored", tier, new))

    def _removed(self, ev: Any, out: list[Change]) -> None:
        tier = self._tier(ev.medium)
        if tier is None:
            return
        gone: list[BlockHash] = []
        for h in ev.block_hashes:
            page = self.pages.get(h)
            if page is None or tier not in page.tiers:
                self.errors["unknown_removed"] += 1
                continue
            page.tiers.discard(tier)
            gone.extend(page.blocks)
            if not page.tiers:
                del self.pages[h]
        if gone:
            out.append(Change("evicted", tier, gone))
