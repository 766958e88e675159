"""A constraint (``events.catalog.OutputConstraint``) as llguidance's grammar text, and the check
that it compiles - no torch, no tokenizer: the torch engine compiles this text with its model's
tokenizer (engine/backends/torch/grammar.py) and the gateway refuses a request whose constraint
fails :func:`validate` (services/drivers/gateway/constraints.py), so both use one compiler.

The grammar is ``start: PREFIX value SUFFIX`` with ``value: %json {SCHEMA}``, the JSON laid out
with fixed whitespace (:data:`JSON_OPTIONS`: ``", "`` and ``": "``, nothing flexible), keywords
llguidance does not implement left unenforced (lenient).
"""

from __future__ import annotations

import hashlib
import json

from events.catalog import OutputConstraint

#: llguidance's JSON options (``x-guidance``): one fixed layout, as ``json.dumps`` writes it; lenient:
#: a keyword llguidance does not implement (``propertyNames``, ``dependentRequired``, ``not``, an
#: unknown ``format``: what schema generators such as zod emit in agents' tool schemas) is not
#: enforced instead of refusing the whole schema; a schema that is wrong (a bad type, a ``$ref``
#: to nothing, a pattern that does not parse) is still refused
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


class GrammarError(ValueError):
    """A constraint that cannot be enforced (the message says why, for the request's error)."""


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def lark(c: OutputConstraint) -> str:
    """The constraint as an llguidance Lark grammar (module docstring)."""
    try:
        schema = json.loads(c.json_schema)
    except ValueError as exc:
        raise GrammarError(f"constraint schema is not JSON: {exc}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("constraint schema must be a JSON object (or a boolean)")
    body = json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
    parts = [_lark_string(p) for p in (c.prefix,) if p] + ["value"] + [_lark_string(s) for s in (c.suffix,) if s]
    return f"start: {' '.join(parts)}\nvalue: %json {body}\n"


def key(c: OutputConstraint) -> str:
    """The cache key of a constraint: a BLAKE2b of its fields."""
    h = hashlib.blake2b(digest_size=16)
    for part in (c.prefix, c.json_schema, c.suffix):
        b = part.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def validate(c: OutputConstraint) -> str:
    """Why ``c`` does not compile ("" when it does), without a tokenizer: the check the gateway
    runs before it publishes a request."""
    import llguidance  # lazy: the engine's optional dependency

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark(c))
    except GrammarError as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar)
