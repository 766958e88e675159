"""The torch engine refuses KV bytes that did not land whole (``evolving chaos --engines torch``,
``cut-kv-transfer``): a transfer cut mid-way (``cut_transfers``: half of its bytes, reported a
success) is caught by the sender's checksums, nothing of it is adopted, and the request
recomputes the blocks: the same greedy tokens as the reference. Before, the torn bytes were
used as the request's KV (P->D pull) or kept in L2 as the peer's blocks (peer fetch)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from events.catalog import FetchStep
from events.hashing import block_hashes
from tests.unit.engine.torch.cluster import Cluster, tiny_checkpoint
from tests.unit.engine.torch.test_torch_engine import prompt, reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _agree(c: Cluster, node: str) -> None:
    """What the node holds, its slot maps and the directory folding its events are one thing."""
    kv = c.nodes[node].kv
    for tier in ("L1", "L2"):
        assert set(kv.slot[tier]) == kv.pool.tier(tier) == set(c.dir.copies(node, tier)), tier


async def test_a_cut_prefill_to_decode_pull_is_refused_and_the_decode_node_recomputes(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "b": "decode"}).start()
    try:
        c.nodes["a"].transfer.cut_transfers = 1  # a writes the KV into b's staging slots: half of it
        p = prompt(21, 300)
        out = await (c.submit("a", "r", p, 8, decode="b") and c.finished("r"))
        assert out == reference(ckpt, p, 8)
        assert c.nodes["a"].transfer.cut_transfers == 0  # the cut happened
        assert c.nodes["b"].counters["recomputed"] == 1 and c.nodes["b"].counters["pulled_blocks"] == 0
        assert not c.of("KvMoved", "r")  # nothing of the torn bytes was adopted
        assert set(block_hashes(p)) <= {b for e in c.of("KvStored", "r", node="b") for b in e.blocks}
        _agree(c, "b")
    finally:
        await c.stop()


async def test_a_cut_peer_fetch_is_refused_its_blocks_dropped_and_the_prefill_computes_them(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "c": "collocated"}).start()
    try:
        p1 = prompt(22, 260)
        out1 = await (c.submit("c", "r1", p1, 4) and c.finished("r1"))
        p2 = p1 + out1 + prompt(23, 40)
        plan = [FetchStep(src_node="c", tier="L2", first_block=0, n_blocks=4)]
        c.nodes["a"].transfer.cut_transfers = 1  # a reads c's L2 blocks: half of the bytes land
        out2 = await (c.submit("a", "r2", p2, 6, decode="a", fetch_plan=plan) and c.finished("r2"))
        assert out2 == reference(ckpt, p2, 6)
        assert c.nodes["a"].transfer.cut_transfers == 0
        assert not c.of("KvFetched", "r2")
        st = next(e for e in c.of("RequestStarted", "r2") if e.phase == "prefill")
        assert st.cached_tokens == 0 and st.fetched_tokens == 0  # computed, not taken from torn bytes
        _agree(c, "a")
    finally:
        await c.stop()


async def test_whole_transfers_still_move_and_carry_the_senders_checksums(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "b": "decode"}).start()
    try:
        p = prompt(24, 200)
        out = await (c.submit("a", "r", p, 6, decode="b") and c.finished("r"))
        assert out == reference(ckpt, p, 6)
        assert c.nodes["b"].counters["recomputed"] == 0 and len(c.of("KvMoved", "r")) == 1
    finally:
        await c.stop()


async def test_a_cut_pull_over_staging_slots_that_hold_the_same_blocks_from_an_earlier_pull_is_refused(ckpt):
    """Staging slots are handed out lowest first, so a prompt pulled again lands in the slots an
    earlier pull of the same prefix left its bytes in: a cut that delivers only the first half
    would then leave the right bytes behind and pass the checksums unseen (the full
    ``chaos --engines torch`` run waited 30 s for a refusal after a decode node restarted with an
    empty L1). The receiver poisons its staging slots before it asks for a pull."""
    c = await Cluster(ckpt, {"a": "prefill", "b": "decode", "d": "decode"}).start()
    try:
        p = prompt(25, 300)
        out1 = await (c.submit("a", "r1", p, 4, decode="b") and c.finished("r1"))
        stage_b, stage_d = c.nodes["b"].kv.pools["stage"].bytes, c.nodes["d"].kv.pools["stage"].bytes
        assert stage_b.any()  # r1's KV is still in b's freed staging slots
        stage_d.copy_(stage_b)  # d's staging slots as if d had pulled the same prompt before
        c.nodes["a"].transfer.cut_transfers = 1
        out2 = await (c.submit("a", "r2", p, 4, decode="d") and c.finished("r2"))
        assert out1 == out2 == reference(ckpt, p, 4)
        assert c.nodes["a"].transfer.cut_transfers == 0  # the cut happened
        assert c.nodes["d"].counters["recomputed"] == 1 and not c.of("KvMoved", "r2")
        _agree(c, "d")
    finally:
        await c.stop()
