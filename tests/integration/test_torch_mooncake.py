"""Two torch engines moving KV with Mooncake over TCP and their control messages over TCP (what
two worker processes do): prefilled on A, decoded on B, the prefix of a continuation fetched
from B's L2 by A; the same greedy tokens as the model recomputing the whole sequence."""

from __future__ import annotations

import pytest

from engine.transfer.mooncake import mooncake_available
from events.catalog import FetchStep
from events.hashing import block_hashes
from tests.unit.engine.torch.cluster import Cluster, tiny_checkpoint
from tests.unit.engine.torch.test_torch_engine import prompt, reference

ok, why = mooncake_available()
pytestmark = pytest.mark.skipif(not ok, reason=f"Mooncake unavailable: {why}")


async def test_kv_moves_and_fetches_over_mooncake_tcp(tmp_path):
    ck = tiny_checkpoint(tmp_path / "tiny.gguf")
    c = await Cluster(ck, {"a": "collocated", "b": "collocated"}, transfer="mooncake", exchange=None,
                      fabric=None).start()
    try:
        assert c.nodes["a"].transfer_endpoint.startswith("mooncake://")
        p1 = prompt(20, 180)
        out1 = await (c.submit("a", "r1", p1, 6, decode="b") and c.finished("r1"))
        assert out1 == reference(ck, p1, 6) and c.of("KvMoved", "r1")[0].blocks
        c.nodes["a"].kv.drop_all()  # a's copy is gone (evicted): the prefix is b's, in its L2
        p2 = p1 + out1 + prompt(21, 10)
        plan = [FetchStep(src_node="b", tier="L2", first_block=0, n_blocks=2)]
        out2 = await (c.submit("a", "r2", p2, 4, fetch_plan=plan) and c.finished("r2"))
        assert out2 == reference(ck, p2, 4)
        assert c.nodes["b"].counters["recomputed"] == 0
        f = c.of("KvFetched", "r2")
        assert len(f) == 1 and f[0].src_node == "b" and f[0].blocks == block_hashes(p2)[:2]
        assert next(e for e in c.of("RequestStarted", "r2") if e.phase == "prefill").fetched_tokens == 128
    finally:
        await c.stop()
