"""A pull larger than the staging pool moves in chunks (``kv.Staging``): the decode node takes
the slots it is granted, the prefill node writes that chunk (its L1-only blocks through its own
staging, also in chunks), the decode node copies it into private L1 slots and gives the slots
back, then the next chunk; one ``KvMoved`` in all. Before, a prompt over the pool failed the
pull ("pool full: 51 slots asked, 32 free of 32") and the decode node recomputed the prompt."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from engine.backends.torch.kv import Staging
from events.hashing import block_hashes
from kernels.pool import SlotAllocator
from tests.unit.engine.torch.cluster import Cluster, tiny_checkpoint
from tests.unit.engine.torch.test_torch_engine import prompt, reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


async def test_staging_grants_what_is_free_and_a_receiver_waits_while_none_is():
    st = Staging(SlotAllocator(8))  # reserve 2: receivers hold at most 6
    assert st.reserve == 2
    serving = await st.take(3, receiving=False)  # a pull being served holds slots 0-2
    first = await st.take(20, receiving=True)  # 5 free: a chunk of 5, not a failure
    assert (serving, first) == ([0, 1, 2], [3, 4, 5, 6, 7])
    waiting = asyncio.create_task(st.take(4, receiving=True))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # nothing free
    st.give(serving, receiving=False)  # 3 free, but receivers hold 5 of their 6
    assert await waiting == [0]
    assert st.receiving == 6 and st.grant(4, receiving=True) == 0
    assert st.grant(4, receiving=False) == 2  # the reserve: a sender always gets slots
    st.give(first, receiving=True)
    assert st.grant(9, receiving=True) == 5 and st.alloc.num_free == 7
    assert await st.take(0, receiving=True) == []


async def test_a_pool_of_one_slot_has_no_reserve_and_an_empty_pool_refuses():
    one = Staging(SlotAllocator(1))
    assert one.reserve == 0 and await one.take(5, receiving=True) == [0]
    with pytest.raises(Exception, match="no staging pool"):
        await Staging(SlotAllocator(0)).take(1, receiving=True)


def _no_prefill_on(c: Cluster, node: str, rid: str) -> None:
    assert c.nodes[node].counters["recomputed"] == 0
    assert not [e for e in c.of("IterationDone", node=node) if e.phase == "prefill"]
    assert [e.phase for e in c.of("RequestStarted", rid) if e.node == node] == ["decode"]


@pytest.mark.parametrize("busy", [0, 2], ids=["free-pool", "pool-partly-busy"])
async def test_a_prompt_three_times_the_staging_pool_is_pulled_in_chunks_not_recomputed(ckpt, busy):
    # 4 staging blocks a node (receivers: 3 at a time); L2 of 4 blocks on the prefill node, so
    # most of the prompt is served from its L1 through its own staging pool, in chunks too
    c = await Cluster(ckpt, {"a": "prefill", "b": "decode"}, staging_blocks=4, l2_blocks=4).start()
    held = {n: c.nodes[n].kv.alloc["stage"].alloc(busy) for n in c.nodes}  # other transfers' slots
    try:
        p = prompt(31, 12 * 64 + 10)  # 12 full blocks and a partial one: 13 to pull, 3x the pool
        out = await (c.submit("a", "r", p, 6, decode="b") and c.finished("r"))
        assert out == reference(ckpt, p, 6)
        _no_prefill_on(c, "b", "r")
        mv = c.of("KvMoved", "r")
        assert len(mv) == 1 and mv[0].blocks == block_hashes(p) and (mv[0].src_node, mv[0].dst_node) == ("a", "b")
        b = c.nodes["b"]
        assert b.counters["pulled_blocks"] == 13 and c.nodes["a"].counters["served_blocks"] == 13
        assert b.counters["pull_chunks"] == -(-13 // min(3, 4 - busy))  # each chunk what staging granted
        assert len(c.nodes["a"].kv.slot["L2"]) <= 4  # so 9+ blocks left a's L1 through its 4 - busy slots
        assert not c.nodes["a"].handoffs  # dropped at the last chunk, not before
        for n in c.nodes:  # every staging slot given back
            assert c.nodes[n].kv.alloc["stage"].num_free == 4 - busy and c.nodes[n].kv.staging.receiving == 0
        assert set(b.kv.slot["L1"]) == b.kv.pool.tier("L1") == set(c.dir.copies("b", "L1"))
    finally:
        for n, slots in held.items():
            c.nodes[n].kv.alloc["stage"].free(slots)
        await c.stop()
