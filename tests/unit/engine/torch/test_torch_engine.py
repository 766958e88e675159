"""The torch reference engine computes the same greedy tokens however its KV got there, the way
PD connectors are tested: (a) one node, continuously batched; (b) prefilled on A, decoded on B
with the KV moved; (c) the prefix fetched from C's L2; (d) across an in-place role switch of the
node holding the KV; (e) after that KV was evicted and recomputed. The reference is the model
run from scratch on the whole sequence for every token (no cache, no scheduler)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.backends.torch.loader import (
    CheckpointError,
    byte_vocab,
    load,
    random_weights,
    write_gguf,
    write_safetensors,
)
from engine.backends.torch.model import Llama, greedy
from events.catalog import FetchStep
from events.hashing import block_hashes
from kernels.pool import BlockPool
from tests.unit.engine.torch.cluster import TINY, Cluster, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def reference(ckpt, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens, recomputing the whole sequence at every step in one contiguous pool."""
    m = ckpt.models.get(("ref",)) or ckpt.models.setdefault(("ref",), Llama(ckpt.cfg, ckpt.weights))
    seq, out = list(prompt), []
    for _ in range(n):
        L = len(seq)
        k = -(-L // 64)
        pool = BlockPool(ckpt.cfg.kv_layout(), k)
        pos = torch.arange(L)[None]
        logits = m.forward(pool.typed(), torch.tensor([seq]), pos, torch.tensor([L]),
                           (pos[0] // 64, pos[0] % 64), torch.arange(k)[None], torch.tensor([L]), torch.tensor([L - 1]))
        out.append(greedy(logits)[0])
        seq.append(out[-1])
    return out


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab, (n,), generator=g).tolist()


async def test_one_node_continuous_batching_matches_the_reference(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}).start()
    try:
        p1, p2 = prompt(1, 150), prompt(2, 70)
        c.submit("a", "r1", p1, 60)
        while not [e for e in c.of("IterationDone") if e.phase == "decode"]:
            await asyncio.sleep(0.001)
        c.submit("a", "r2", p2, 8)  # r2 joins while r1 decodes (59 steps to go)
        assert await c.finished("r1") == reference(ckpt, p1, 60)
        assert await c.finished("r2") == reference(ckpt, p2, 8)
        decode_batches = {e.batch for e in c.of("IterationDone") if e.phase == "decode"}
        assert 2 in decode_batches  # both decoded in one forward
        pre = [e for e in c.of("IterationDone") if e.phase == "prefill"]
        assert sum(e.sum_t_uc for e in pre) == 150 + 70 and all(e.duration_s > 0 for e in pre)
        assert set(block_hashes(p1)) <= set(c.dir.copies("a", "L1")) and set(block_hashes(p1)) <= set(c.dir.copies("a", "L2"))
    finally:
        await c.stop()


async def test_a_continuation_prefills_only_its_new_tokens(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}).start()
    try:
        p1 = prompt(3, 140)
        out1 = await (c.submit("a", "r1", p1, 60) and c.finished("r1"))
        # 230 tokens; r1 computed the KV of 140 + 59 tokens: 3 full blocks (2 of prompt, 1 of output)
        p2 = p1 + out1 + prompt(4, 30)
        out2 = await (c.submit("a", "r2", p2, 5) and c.finished("r2"))
        assert out2 == reference(ckpt, p2, 5)
        st = next(e for e in c.of("RequestStarted", "r2") if e.phase == "prefill")
        assert st.cached_tokens == 192
        it = [e for e in c.of("IterationDone") if e.phase == "prefill"][-1]
        assert (it.sum_t_uc, it.sum_t_c) == (230 - 192, 192)
        assert it.sum_A == 38 * 192 + 38 * 39 / 2
    finally:
        await c.stop()


async def test_prefill_on_a_decode_on_b_moves_the_kv(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "b": "decode"}).start()
    try:
        p = prompt(5, 200)
        out = await (c.submit("a", "r", p, 10, decode="b") and c.finished("r"))
        assert out == reference(ckpt, p, 10)
        mv = c.of("KvMoved", "r")
        assert len(mv) == 1 and (mv[0].src_node, mv[0].dst_node) == ("a", "b") and mv[0].blocks == block_hashes(p)
        assert [e.node for e in c.of("RequestStarted", "r")] == ["a", "b"]
        assert c.nodes["a"].counters["served_blocks"] == 4 and c.nodes["b"].counters["pulled_blocks"] == 4
        assert not c.nodes["a"].handoffs and c.nodes["a"].kv.pool.reserved_tokens == 0
    finally:
        await c.stop()


async def test_prefix_fetched_from_a_peer_l2(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "c": "collocated"}).start()
    try:
        p1 = prompt(6, 200)
        out1 = await (c.submit("c", "r1", p1, 4) and c.finished("r1"))
        p2 = p1 + out1 + prompt(7, 50)
        plan = [FetchStep(src_node="c", tier="L2", first_block=0, n_blocks=3)]
        out2 = await (c.submit("a", "r2", p2, 6, decode="a", fetch_plan=plan) and c.finished("r2"))
        assert out2 == reference(ckpt, p2, 6)
        f = c.of("KvFetched", "r2")
        assert len(f) == 1 and f[0].blocks == block_hashes(p2)[:3] and f[0].src_node == "c"
        st = next(e for e in c.of("RequestStarted", "r2") if e.phase == "prefill")
        assert st.cached_tokens == 192 and st.fetched_tokens == 192
    finally:
        await c.stop()


async def test_across_a_role_switch_of_the_node_that_holds_the_kv(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "b": "prefill", "d": "decode"}).start()
    try:
        p1 = prompt(8, 130)
        out1 = await (c.submit("a", "r1", p1, 6, decode="d") and c.finished("r1"))
        c.hosts["a"].catch_up()
        c.nodes["a"].order_switch("decode", "in_place")
        while not c.of("RoleSwitched"):
            await asyncio.sleep(0.005)
        sw = c.of("RoleSwitched")[0]
        assert (sw.role, sw.kv_dropped) == ("decode", False) and c.nodes["a"].role == "decode"
        assert set(block_hashes(p1)) <= set(c.dir.copies("a", "L2"))  # the KV stayed
        p2 = p1 + out1 + prompt(9, 20)
        plan = [FetchStep(src_node="a", tier="L2", first_block=0, n_blocks=2)]
        out2 = await (c.submit("b", "r2", p2, 7, decode="a", fetch_plan=plan) and c.finished("r2"))
        assert out2 == reference(ckpt, p2, 7)
        assert c.of("KvFetched", "r2")[0].src_node == "a" and c.of("KvMoved", "r2")[0].dst_node == "a"
    finally:
        await c.stop()


async def test_after_eviction_the_kv_is_recomputed(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}, l1_blocks=8, l2_blocks=6).start()
    try:
        p1, p2 = prompt(10, 260), prompt(11, 260)
        out1 = await (c.submit("a", "r1", p1, 5) and c.finished("r1"))
        await (c.submit("a", "r2", p2, 5) and c.finished("r2"))
        ev = {b for e in c.of("KvEvicted") for b in e.blocks}
        assert set(block_hashes(p1)) & ev  # r2 pushed r1's blocks out
        again = await (c.submit("a", "r3", p1, 5) and c.finished("r3"))
        assert again == out1 == reference(ckpt, p1, 5)
        st = next(e for e in c.of("RequestStarted", "r3") if e.phase == "prefill")
        assert st.cached_tokens < 256
    finally:
        await c.stop()


async def test_a_failed_kv_pull_recomputes_the_prompt_on_the_decode_node(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "b": "decode"}).start()
    try:
        c.nodes["b"].peer_registered("a", "")  # b does not know where a's KV is
        p = prompt(12, 100)
        out = await (c.submit("a", "r", p, 6, decode="b") and c.finished("r"))
        assert out == reference(ckpt, p, 6)
        assert c.nodes["b"].counters["recomputed"] == 1 and not c.of("KvMoved", "r")
        assert len(c.of("FirstToken", "r")) == 1
    finally:
        await c.stop()


async def test_trace_requests_without_tokens_run_on_ids_made_from_their_blocks(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}).start()
    try:
        blocks = [777, 778]
        c.submit("a", "t1", None, 3, blocks=blocks, prompt=150)
        await c.finished("t1")
        assert set(blocks) <= set(c.dir.copies("a", "L1"))
        c.submit("a", "t2", None, 3, blocks=blocks + [779], prompt=200)
        await c.finished("t2")
        st = next(e for e in c.of("RequestStarted", "t2") if e.phase == "prefill")
        assert st.cached_tokens == 128
    finally:
        await c.stop()


def test_gguf_and_safetensors_load_the_same_model_and_the_tokenizer(tmp_path):
    w = random_weights(TINY, 5, tied=False)
    write_gguf(tmp_path / "m.gguf", TINY, w, tokens=byte_vocab(TINY.vocab))
    write_safetensors(tmp_path / "hf", TINY, w)
    a, b = load(str(tmp_path / "m.gguf")), load(str(tmp_path / "hf"))
    assert set(a.weights) == set(b.weights) == set(w)
    for k in w:
        assert torch.equal(a.weights[k], w[k]) and torch.equal(b.weights[k], w[k]), k
    assert (a.cfg.layers, a.cfg.heads, a.cfg.kv_heads, a.cfg.vocab) == (2, 4, 2, TINY.vocab)
    assert a.tokenizer.decode(a.tokenizer.encode("hi there").ids) == "hi there"
    with pytest.raises(CheckpointError, match="does not exist"):
        load(str(tmp_path / "nope.gguf"))
    (tmp_path / "bad").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load(str(tmp_path / "bad"))
