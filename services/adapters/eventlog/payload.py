"""A row's payload: the event as JSON, written so that every event reads back, non-finite floats included.

JSON has no NaN or infinity, and msgspec's encoder writes them as ``null``, which its typed
decoder then refuses for a ``float`` field: one event published with ``ts = NaN`` (a hostile or
broken client; the stream takes any msgpack float) made the whole log unreadable to ``evolving
verify``. So an event holding a non-finite float anywhere (``ts``, a duration, a
score in a list of structs) is written with each such float as the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` (DuckDB casts these strings to ``DOUBLE`` too: SQL over the
payload reads them), every other event exactly as :func:`events.codec.to_json` writes it, byte
for byte.

Reading tries the strict typed decoder first (every row of a finite event); a row it refuses is
decoded again leniently (msgspec's ``strict=False``, which parses those strings back into
floats) with its ``ts`` column standing in for a ``null`` ts (rows written before this module:
DuckDB's ``DOUBLE`` column kept the NaN that the payload lost). A row that still does not decode
raises :class:`events.codec.CodecError` naming its seq: readers hand it to their
``undecodable`` callback and go on.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import msgspec.inspect as mi

from events.catalog import EVENT_TYPES, AnyEvent, Event
from events.codec import CodecError, from_json, to_json
from events.ids import MAX_BLOCK_HASH

__all__ = ["decode_payload", "encode_payload", "has_nonfinite"]

_Check = Callable[[Any], bool]


def _nonfinite_float(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def _any_nonfinite(v: Any) -> bool:
    """Whether a value of any shape (a union's member) holds a non-finite float."""
    if isinstance(v, float):
        return not math.isfinite(v)
    if isinstance(v, msgspec.Struct):
        return any(_any_nonfinite(getattr(v, f)) for f in v.__struct_fields__)
    if isinstance(v, list | tuple):
        return any(map(_any_nonfinite, v))
    if isinstance(v, dict):
        return any(map(_any_nonfinite, v.values()))
    return False


def _float_sum(t: mi.Type, v: str, depth: int = 0) -> str | None:
    """A Python expression over the value ``v`` of type ``t`` that sums every float inside it
    (None: it holds none). The sum is finite only when every term is: NaN and the infinities
    propagate through ``+`` (``inf - inf`` is NaN); a sum that overflows is a false alarm, which
    only costs the careful encoding. Unions and other shapes fall back to :func:`_any_nonfinite`."""
    if isinstance(t, mi.FloatType):
        return v
    if isinstance(t, mi.StructType):
        terms = [x for f in t.fields if (x := _float_sum(f.type, f"{v}.{f.name}", depth)) is not None]
        return " + ".join(terms) if terms else None
    if isinstance(t, mi.ListType | mi.VarTupleType):
        e = f"_e{depth}"
        item = _float_sum(t.item_type, e, depth + 1)
        if item is None:
            return None
        return f"sum({v}, 0.0)" if item == e else f"sum([{item} for {e} in {v}], 0.0)"
    if isinstance(t, mi.UnionType | mi.DictType | mi.AnyType | mi.TupleType | mi.SetType | mi.FrozenSetType):
        members = [getattr(t, a) for a in ("types", "item_types") if hasattr(t, a)]
        inner = [m for ms in members for m in ms] + [getattr(t, a) for a in ("item_type", "value_type") if hasattr(t, a)]
        if isinstance(t, mi.AnyType) or any(_float_sum(m, "x") is not None for m in inner):
            return f"(1.0 if _any_nonfinite({v}) else 0.0)"  # 1.0, never NaN: finite sums stay finite
    return None


def _check_for(event_type: type) -> _Check:
    """``event_type``'s check, compiled from its annotations: one expression, no loop over fields
    (a field holding what its annotation does not say, an event built in Python unchecked, falls
    back to the walk)."""
    expr = _float_sum(mi.type_info(event_type), "v")
    if expr is None:
        return lambda v: False
    scope = {"isfinite": math.isfinite, "_any_nonfinite": _any_nonfinite}
    # TypeError: an UNSET float; AttributeError: an UNSET struct (msgspec.inspect drops UnsetType
    # from the union, so the expression reads a field of UNSET: PlanEvaluated.shift)
    exec(f"def check(v):\n    try:\n        return not isfinite({expr})\n"  # noqa: S102 - from the catalog's types
         "    except (TypeError, AttributeError):\n        return _any_nonfinite(v)", scope)
    return scope["check"]


#: per event type, the check of its float fields (built once from the catalog's annotations)
_CHECKS: dict[type, _Check] = {t: _check_for(t) for t in EVENT_TYPES}

_LAX = msgspec.json.Decoder(AnyEvent, strict=False)


def has_nonfinite(event: Event) -> bool:
    """Whether ``event`` holds a NaN or an infinity in any float field, nested ones included."""
    check = _CHECKS.get(type(event))
    return _any_nonfinite(event) if check is None else check(event)


def _spell(v: Any) -> Any:
    """``v`` with every non-finite float spelt as the string msgspec's lax decoder reads back."""
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: _spell(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_spell(x) for x in v]
    return v


def encode_payload(event: Event) -> bytes:
    """The event's JSON: :func:`events.codec.to_json`, or with its non-finite floats as strings."""
    check = _CHECKS.get(type(event), _any_nonfinite)
    if not check(event):
        return to_json(event)
    return msgspec.json.encode(_spell(msgspec.to_builtins(event)))


def decode_payload(seq: int, payload: str | bytes, ts: float | None = None) -> AnyEvent:
    """The event of a stored row (``ts``: its ``ts`` column, where the log has one). Raises
    :class:`events.codec.CodecError` naming ``seq`` when the row does not decode."""
    try:
        return from_json(payload)
    except CodecError as strict:
        try:
            return _lax(payload, ts)
        except (msgspec.DecodeError, msgspec.ValidationError, CodecError):
            raise CodecError(f"event log row seq={seq}: {strict.reason}") from strict


def _lax(payload: str | bytes, ts: float | None) -> AnyEvent:
    obj = msgspec.json.decode(payload)
    if isinstance(obj, dict) and obj.get("ts", 0) is None and ts is not None:
        obj["ts"] = ts  # written before this module: the payload lost the NaN, the column kept it
        event = msgspec.convert(obj, AnyEvent, strict=False)
    else:
        event = _LAX.decode(payload)
    blocks = getattr(event, "blocks", None)
    if blocks and max(blocks) > MAX_BLOCK_HASH:
        raise CodecError(f"block hash {max(blocks)} does not fit in 64 bits")
    return event
