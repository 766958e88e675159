"""The sim engine's answer to a constraint (engine/backends/sim/instance.py): a minimal value
valid against the schema, the same every time; and the sim backend streams it as the output's
text, whole with finish "stop" or cut at the budget with "length"."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings

from engine.backend import Sampling
from engine.backends.sim.backend import CHARS_PER_TOKEN
from engine.backends.sim.instance import constrained_text, instance
from events.catalog import OutputConstraint, RequestFinished
from tests.contract.test_backend import PROFILE, Harness, job
from tests.hyp import examples
from tests.unit.engine.schemas import schemas

jsonschema_rs = pytest.importorskip("jsonschema_rs")


def valid(schema, value) -> bool:
    return jsonschema_rs.validator_for(schema).is_valid(value)


@settings(max_examples=examples(300), deadline=None)
@given(schemas)
def test_the_instance_of_a_random_schema_validates(schema):
    v = instance(schema)
    assert valid(schema, v), (schema, v)
    assert instance(schema) == v  # deterministic


@pytest.mark.parametrize("schema", [
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "exclusiveMinimum": 3}},
                     "required": ["x"]}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}},
     "required": ["p"]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
               {"properties": {"b": {"type": "number", "minimum": 2.5, "multipleOf": 0.5}}, "required": ["b"]}]},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "minItems": 3,
     "items": {"type": "boolean"}},
    {"type": "string", "pattern": "^[0-9]+$", "minLength": 2},
    {"type": "string", "format": "email"},
    {"type": "integer", "maximum": -7, "multipleOf": 3},
    {"type": ["null", "string"], "minLength": 1},
    {"type": "object", "minProperties": 2, "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
])
def test_keywords(schema):
    assert valid(schema, instance(schema)), instance(schema)


def test_constrained_text_is_laid_out_as_the_grammar_writes_it():
    s = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object",
         "properties": {"city": {"type": "string", "minLength": 1}}, "required": ["city"]}},
         "required": ["name", "arguments"]}
    assert constrained_text(json.dumps(s), "<tool_call>\n", "\n</tool_call>") == \
        '<tool_call>\n{"name": "f", "arguments": {"city": "a"}}\n</tool_call>'


async def _serve(max_tokens: int, constraint: OutputConstraint):
    from engine.backends.sim.backend import SimBackend

    h = Harness(50.0)
    h.backend = SimBackend(h.host, "n1", "collocated", PROFILE, seed=1)
    runner = asyncio.create_task(h.host.run())
    try:
        h.host.catch_up()
        h.backend.enqueue_prefill(replace(job("c", max_tokens=max_tokens), ignore_eos=True,
                                          sampling=Sampling(constraint=constraint)))
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "c")
        msgs = [m for m in h.tokens if m.request == "c"]
        return fin, "".join(m.text for m in msgs), msgs[-1]
    finally:
        runner.cancel()
        await h.backend.close()


async def test_the_sim_backend_streams_the_value_and_ends_when_it_is_whole():
    schema = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 3},
                                               "n": {"type": "integer", "minimum": 10}},
              "required": ["answer", "n"]}
    c = OutputConstraint(json_schema=json.dumps(schema))
    want = constrained_text(c.json_schema)
    n = -(-len(want) // CHARS_PER_TOKEN)
    fin, text, done = await _serve(1000, c)  # ignore_eos true: the value still ends the output
    assert text == want and valid(schema, json.loads(text))
    assert fin.output_tokens == done.total == n and done.finish_reason == "stop"
    fin, text, done = await _serve(3, c)
    assert text == want[:3 * CHARS_PER_TOKEN] and done.finish_reason == "length" and fin.output_tokens == 3
