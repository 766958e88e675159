"""Stage orders on torch engines (engine/backends/torch/peers.py, "stage orders"): a
``KvStageOrdered`` naming a node pulls the finished turn's blocks (prompt + output) from the
decode node's L2 into its own L2, reports ``KvMoved(decode -> prefill, L2)``, and the branch's
next turn prefilled there starts with them cached (restored from L2, nothing fetched, the same
greedy tokens). Orders it cannot carry out are skipped or fail with a log line, nothing else."""

from __future__ import annotations

import asyncio

import pytest

from events.catalog import KvStageOrdered
from events.hashing import block_hashes, hash_block_tokens
from tests.unit.engine.torch.cluster import Cluster, tiny_checkpoint
from tests.unit.engine.torch.test_torch_engine import prompt, reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-stage") / "tiny.gguf")


def order(request: str, src: str, dst: str, tier: str = "L2") -> KvStageOrdered:
    return KvStageOrdered(ts=0.0, src="router", request=request, src_node=src, dst_node=dst, branch="b", tier=tier)


async def until(cond, timeout: float = 10.0) -> None:
    async def poll():
        while not cond():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout)


def turn_blocks(p: list[int], out: list[int]) -> list[int]:
    """The full blocks of prompt + output, as the decode node hashes them."""
    hashes = block_hashes(p)
    toks = p + out
    for i in range(len(hashes), len(toks) // 64):
        hashes.append(hash_block_tokens(hashes[-1], toks[i * 64:(i + 1) * 64]))
    return hashes


async def test_an_order_stages_the_turn_and_the_next_turn_finds_it_cached(ckpt):
    c = await Cluster(ckpt, {"p": "prefill", "d": "decode", "q": "prefill"}).start()
    try:
        p1 = prompt(30, 150)
        out1 = await (c.submit("p", "r1", p1, 60, decode="d", ignore_eos=True) and c.finished("r1"))
        full = turn_blocks(p1, out1)
        assert len(full) == 3  # two prompt blocks, one of the prompt's tail and the output
        # q holds nothing of the branch: the whole turn moves; p lacks only the output's block
        assert c.nodes["q"].stage_in(order("r1", "d", "q")) and c.nodes["p"].stage_in(order("r1", "d", "p"))
        await until(lambda: len(c.of("KvMoved")) == 3)  # the P -> D hand-off and the two stage orders
        moved = {e.dst_node: e for e in c.of("KvMoved") if e.src_phase == "decode"}
        assert moved["q"].blocks == full and moved["p"].blocks == full[2:]
        assert all((e.src_node, e.dst_phase, e.dst_tier, e.branch) == ("d", "prefill", "L2", "b")
                   for e in moved.values())
        assert [b for b in full if b in c.nodes["q"].kv.slot["L2"]] == full
        assert not [b for b in full if b in c.nodes["q"].kv.slot["L1"]]  # the host tier, as ordered
        p2 = p1 + out1 + prompt(31, 20)
        for node, rid in (("q", "r2q"), ("p", "r2p")):
            out2 = await (c.submit(node, rid, p2, 4) and c.finished(rid))
            assert out2 == reference(ckpt, p2, 4)
            st = next(e for e in c.of("RequestStarted", rid) if e.phase == "prefill")
            assert (st.cached_tokens, st.fetched_tokens) == (192, 0), node
            assert not c.of("KvFetched", rid)
        assert c.nodes["q"].counters["staged_blocks"] == 3 and c.nodes["p"].counters["staged_blocks"] == 1
    finally:
        await c.stop()


async def test_orders_that_cannot_be_carried_out_are_logged_and_skipped(ckpt):
    c = await Cluster(ckpt, {"p": "prefill", "d": "decode", "q": "prefill"}).start()
    try:
        p1 = prompt(32, 140)
        out1 = await (c.submit("p", "r1", p1, 10, decode="d", ignore_eos=True) and c.finished("r1"))
        q = c.nodes["q"]
        assert not q.stage_in(order("r1", "ghost", "q"))  # unknown source node
        assert not q.stage_in(order("r1", "q", "q"))  # the source is the node itself
        assert not q.stage_in(order("r1", "d", "elsewhere"))  # not addressed to it
        assert q.stage_in(order("gone", "d", "q"))  # a turn the source never decoded (or forgot)
        await until(lambda: q.counters["stage_failed"] == 1)
        assert q.stage_in(order("r1", "d", "q"))
        await until(lambda: q.counters["staged_blocks"] == 2)
        assert not q.stage_in(order("r1", "d", "q"))  # a duplicate
        c.nodes["d"].kv.drop_all()  # the source's KV is gone: nothing moves
        assert c.nodes["p"].stage_in(order("r1", "d", "p"))
        await until(lambda: "r1" in c.nodes["p"]._staged)
        assert q.counters["stage_skipped"] == 4 and c.nodes["p"].counters["staged_blocks"] == 0
        assert len([e for e in c.of("KvMoved") if e.src_phase == "decode"]) == 1
        # nothing stopped: the next turn is served on q with the staged blocks
        p2 = p1 + out1 + prompt(33, 5)
        assert await (c.submit("q", "r2", p2, 3) and c.finished("r2")) == reference(ckpt, p2, 3)
        assert next(e for e in c.of("RequestStarted", "r2") if e.phase == "prefill").cached_tokens == 128
    finally:
        await c.stop()


async def test_no_room_in_the_host_tier_moves_nothing_and_keeps_what_is_there(ckpt):
    c = await Cluster(ckpt, {"p": "prefill", "d": "decode", "q": "prefill"}, l2_blocks=4).start()
    try:
        p1 = prompt(34, 150)
        await (c.submit("p", "r1", p1, 60, decode="d", ignore_eos=True) and c.finished("r1"))
        p0 = prompt(35, 260)
        await (c.submit("q", "r0", p0, 2, ignore_eos=True) and c.finished("r0"))
        q = c.nodes["q"]
        mine = block_hashes(p0)
        assert [b for b in mine if b in q.kv.slot["L2"]] == mine  # q's host tier is full
        q.kv.pool.pin(("busy", 0), mine)  # ... and in use: nothing may be evicted for the order
        assert q.stage_in(order("r1", "d", "q"))
        await until(lambda: "r1" in q._staged)
        assert not [e for e in c.of("KvMoved") if e.dst_node == "q"]
        assert [b for b in mine if b in q.kv.slot["L2"]] == mine and q.counters["staged_blocks"] == 0
    finally:
        await c.stop()
