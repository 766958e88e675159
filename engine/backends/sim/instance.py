"""The sim engine's answer to a constraint: a minimal JSON value valid against a JSON Schema,
the same for the same schema (pure: stdlib only, no I/O, no randomness).

The sim engine writes no model text, but a client that forces a tool call or asks for JSON must
get a value it can parse and validate (a real agent acts on it), so a constrained request's
output is ``prefix + json + suffix`` (:func:`constrained_text`), the JSON laid out as the torch
engine's grammar writes it (``", "`` and ``": "``; engine/backends/torch/grammar.py).

The value (:func:`instance`), by keyword: ``$ref`` (local, ``#/...``) is followed; ``const``,
then the first ``enum`` member; ``allOf`` merged (properties, ``required``, bounds); the first
branch of ``anyOf`` / ``oneOf``; ``type`` (the first listed; inferred from the keywords when
absent: ``properties`` -> object, ``items`` -> array, ``minLength`` -> string, ...; nothing: null).
Objects get their ``required`` properties (and more, in order, up to ``minProperties``), arrays
``minItems`` items (``prefixItems`` first), strings ``minLength`` characters (a known ``format``:
a fixed valid example; a ``pattern``: the first of a few candidates that matches), numbers the
value nearest 0 inside the bounds, on ``multipleOf``. Not covered (the value may then not
validate): ``not``, ``if``/``then``, ``dependentRequired``, a ``oneOf`` whose first branch's value
matches another branch, a ``pattern`` none of the candidates matches.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: a fixed valid example per string ``format``
FORMATS = {"date-time": "1970-01-01T00:00:00Z", "date": "1970-01-01", "time": "00:00:00Z",
           "email": "a@example.com", "uri": "https://example.com", "url": "https://example.com",
           "hostname": "example.com", "ipv4": "0.0.0.0", "ipv6": "::1",
           "uuid": "00000000-0000-0000-0000-000000000000", "duration": "P0D"}
_CANDIDATES = ("", "a", "0", "A", "a0", "aa", "00", "example", "a@example.com", "https://example.com")
_MAX_DEPTH = 32  # a recursive $ref with a required self-reference has no finite instance


def constrained_text(json_schema: str, prefix: str = "", suffix: str = "") -> str:
    """The sim engine's whole output for a constraint (module docstring)."""
    schema = json.loads(json_schema)
    value = instance(schema)
    return prefix + json.dumps(value, ensure_ascii=False, separators=(", ", ": ")) + suffix


def instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """A minimal value valid against ``schema`` (module docstring)."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None  # true / {}: anything; false has no instance
    if "$ref" in schema:
        return instance(_merge(_resolve(root, schema["$ref"]), {k: v for k, v in schema.items() if k != "$ref"}),
                        root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if isinstance(schema.get("allOf"), list):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged = _merge(merged, _resolve(root, part["$ref"]) if isinstance(part, dict) and "$ref" in part
                            else part)
        return instance(merged, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            rest = {k: v for k, v in schema.items() if k != key}
            return instance(_merge(rest, schema[key][0]), root, depth + 1)
    kind = _type(schema)
    if kind == "object":
        return _object(schema, root, depth)
    if kind == "array":
        return _array(schema, root, depth)
    if kind == "string":
        return _string(schema)
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return False
    return None


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        return {}  # a remote reference: nothing known
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node.get(part, {}) if isinstance(node, dict) else {}
    return node


def _merge(a: Any, b: Any) -> dict:
    """``allOf`` of two schemas, as far as an instance needs: properties and ``required`` united,
    the tighter bound of each pair, else ``b``'s keyword."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a if isinstance(a, dict) else b if isinstance(b, dict) else {}
    out = dict(a)
    for k, v in b.items():
        if k == "properties" and isinstance(out.get(k), dict) and isinstance(v, dict):
            out[k] = {**out[k], **{n: _merge(out[k].get(n, {}), s) for n, s in v.items()}}
        elif k == "required" and isinstance(out.get(k), list) and isinstance(v, list):
            out[k] = out[k] + [n for n in v if n not in out[k]]
        elif k in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties") and k in out:
            out[k] = max(out[k], v)
        elif k in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties") and k in out:
            out[k] = min(out[k], v)
        else:
            out[k] = v
    return out


def _type(schema: dict) -> str | None:
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), t[0] if t else None)
    if isinstance(t, str):
        return t
    if any(k in schema for k in ("properties", "required", "additionalProperties", "minProperties")):
        return "object"
    if any(k in schema for k in ("items", "prefixItems", "minItems", "maxItems")):
        return "array"
    if any(k in schema for k in ("minLength", "maxLength", "pattern", "format")):
        return "string"
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
        return "number"
    return None


def _object(schema: dict, root: Any, depth: int) -> dict:
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    names = [n for n in schema.get("required", []) if isinstance(n, str)]
    for n in props:
        if len(names) >= int(schema.get("minProperties", 0)):
            break
        if n not in names:
            names.append(n)
    extra = schema.get("additionalProperties", {})
    return {n: instance(props[n] if n in props else extra if isinstance(extra, dict) else {}, root, depth + 1)
            for n in names}


def _array(schema: dict, root: Any, depth: int) -> list:
    prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
    items = schema.get("items", {})
    n = int(schema.get("minItems", 0))
    out = [instance(s, root, depth + 1) for s in prefix[:max(n, 0)]] if n else []
    while len(out) < n:
        out.append(instance(items if isinstance(items, dict) else {}, root, depth + 1))
    return out


def _string(schema: dict) -> str:
    lo = int(schema.get("minLength", 0))
    hi = schema.get("maxLength")
    fmt = FORMATS.get(schema.get("format", ""))
    pattern = schema.get("pattern")
    candidates = ([fmt] if fmt else []) + ["a" * lo] + [c.ljust(lo, "a") for c in _CANDIDATES]
    for c in candidates:
        if len(c) < lo or (hi is not None and len(c) > hi):
            continue
        if pattern is None or _search(pattern, c):
            return c
    return "a" * lo


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


def _number(schema: dict, integer: bool) -> int | float:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")

    def ok(v: float) -> bool:
        return ((lo is None or v >= lo) and (hi is None or v <= hi) and (xlo is None or v > xlo)
                and (xhi is None or v < xhi) and (not integer or float(v).is_integer()))

    step = schema.get("multipleOf")
    if not (isinstance(step, (int, float)) and step > 0):
        step = 1 if integer else None
    low = max([b for b in (lo, xlo) if isinstance(b, (int, float))], default=None)
    high = min([b for b in (hi, xhi) if isinstance(b, (int, float))], default=None)
    if step is None:  # a float: 0, a bound, or between the bounds
        cands = [0, lo, hi, xlo + 1 if xlo is not None else None, xhi - 1 if xhi is not None else None,
                 (low + high) / 2 if low is not None and high is not None else None]
        return next((v for v in cands if v is not None and ok(v)), 0)
    k0 = math.ceil(low / step) if low is not None and low > 0 else math.floor(high / step) if high is not None and high < 0 else 0
    for d in range(2000):  # the multiples of step nearest the bounds (or 0) first
        for k in ((k0 + d, k0 - d) if d else (k0,)):
            v = k * step
            if ok(v):
                return int(v) if integer or float(v).is_integer() and isinstance(step, int) else v
    return k0 * step
