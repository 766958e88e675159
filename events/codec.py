"""Wire codec: msgpack bodies, schema version in the message header.

One encoder and one typed decoder are built once and reused (msgspec's fast path).
The schema version travels in the ``Ei-Schema`` header as ``MAJOR.MINOR``. A reader accepts
any minor version of its own major (new fields have defaults, unknown fields are ignored) and
refuses a newer major with :class:`SchemaVersionError`.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from events.catalog import AnyEvent, Event
from events.ids import MAX_BLOCK_HASH

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 6  # 1.2: RequestCancelled; 1.3: RequestSubmitted sampling fields; 1.4: its constraint;
# 1.5: PlanEvaluated.shift; 1.6: PlanEvaluated.backlog, Candidate.measured_ttft_p95_s and
# throughput_with_queue
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"
SCHEMA_HEADER = "Ei-Schema"

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AnyEvent)
_JSON_ENCODER = msgspec.json.Encoder()
_JSON_DECODER = msgspec.json.Decoder(AnyEvent)


class CodecError(ValueError):
    """A message could not be turned into an event; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SchemaVersionError(CodecError):
    """The message was written by a newer major version of the catalog."""


def encode(event: Event) -> bytes:
    """Encode one event to msgpack."""
    return _ENCODER.encode(event)


def decode(data: bytes) -> AnyEvent:
    """Decode msgpack bytes into a typed event; raise :class:`CodecError` on bad input."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"undecodable event payload ({len(data)} bytes): {exc}") from exc


def headers() -> dict[str, str]:
    """Headers every published event carries."""
    return {SCHEMA_HEADER: SCHEMA_VERSION}


def check_schema(version: str | None) -> None:
    """Refuse a payload written by a newer major schema version.

    A missing header is read as the current version (tools such as ``nats pub`` send none).
    """
    if version is None:
        return
    try:
        major = int(version.split(".", 1)[0])
    except ValueError as exc:
        raise SchemaVersionError(f"malformed schema version header {SCHEMA_HEADER}={version!r}") from exc
    if major > SCHEMA_MAJOR:
        raise SchemaVersionError(
            f"event written with schema {version}, this reader understands major {SCHEMA_MAJOR} "
            f"(<= {SCHEMA_VERSION}); upgrade evolving-infra to read it"
        )


def decode_message(data: bytes, hdrs: Mapping[str, str] | None) -> AnyEvent:
    """Check the schema header, then decode. Raises :class:`CodecError` subclasses."""
    check_schema(hdrs.get(SCHEMA_HEADER) if hdrs else None)
    return decode(data)


def to_json(event: Event) -> bytes:
    """JSON form of an event (same field names and tag), for DuckDB and humans."""
    return _JSON_ENCODER.encode(event)


def from_json(data: bytes | str) -> AnyEvent:
    try:
        event = _JSON_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"undecodable JSON event: {exc}") from exc
    blocks = getattr(event, "blocks", None)
    if blocks and max(blocks) > MAX_BLOCK_HASH:  # JSON integers have no 64-bit ceiling; msgpack's do
        raise CodecError(f"undecodable JSON event: block hash {max(blocks)} does not fit in 64 bits - at `$.blocks`")
    return event


def to_builtins(event: Event) -> dict:
    """Plain dict form (``type`` tag included)."""
    return msgspec.to_builtins(event)
