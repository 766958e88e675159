"""The torch engine writes its computed blocks through to L2 with one ``KvStored(write_through=True)``
where L1 and L2 add the same blocks, as the simulator's ``KvPool.store_through`` does; when
L2 already holds some of them, it still sends the L1 event, then the L2 one. Either way the directory
ends with the blocks in both tiers and the bytes in L2 are L1's."""

from __future__ import annotations

import pytest
import torch

from events.hashing import block_hashes
from tests.unit.engine.torch.cluster import TINY, Cluster, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab, (n,), generator=g).tolist()


def _stores(c: Cluster, rid: str) -> list[tuple[str, list[int], bool]]:
    return [(e.tier, list(e.blocks), e.write_through is True) for e in c.of("KvStored", rid, node="a")]


async def test_computed_blocks_are_one_write_through_event(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}).start()
    try:
        p = _prompt(11, 150)  # 2 full prompt blocks; 150 + 59 computed tokens: a 3rd block at the end
        await c.finished(c.submit("a", "r1", p, 60).request)
        prompt_blocks = block_hashes(p)
        stores = _stores(c, "r1")
        assert stores[0] == ("L1", prompt_blocks, True)  # the prompt's blocks: L1 and L2 in one event
        assert len(stores) == 2 and stores[1][0] == "L1" and stores[1][2] and len(stores[1][1]) == 1
        assert not [e for e in c.of("KvStored", node="a") if e.tier == "L2"]  # no separate L2 store
        held = stores[0][1] + stores[1][1]
        assert set(held) <= set(c.dir.copies("a", "L1")) and set(held) <= set(c.dir.copies("a", "L2"))
        kv = c.nodes["a"].kv
        for h in held:  # L2's bytes are the L1 copy's
            assert torch.equal(kv.pools["L2"].bytes[kv.slot["L2"][h]], kv.pools["L1"].bytes[kv.slot["L1"][h]].cpu())
    finally:
        await c.stop()


async def test_a_partly_held_l2_keeps_the_pair(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}).start()
    try:
        p = _prompt(12, 140)
        blocks = block_hashes(p)
        kv = c.nodes["a"].kv
        # L2 already holds the second block, not the first (so nothing is restored from it: the
        # held L2 prefix is empty) and the prefill computes both
        assert kv.add_l2([blocks[1]], []) is not None
        await c.finished(c.submit("a", "r1", p, 2).request)
        stores = _stores(c, "r1")
        assert stores[:2] == [("L1", blocks, False), ("L2", blocks[:1], False)]  # L2 adds what it lacked
    finally:
        await c.stop()
