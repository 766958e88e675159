"""SGLang's KV-event wire format, mirrored (no SGLang import): what its ``ZmqEventPublisher``
sends for ``--kv-events-config`` (sglang/srt/disaggregation/kv_events.py, 0.5.23).

One ZMQ message = three frames: ``topic`` (bytes), ``seq`` (8-byte big-endian, per publisher,
from 0), ``payload`` = msgpack of ``KVEventBatch``: a positional array ``[ts, events,
attn_dp_rank]``; each event a msgpack *map* tagged by ``"type"`` (the class name), defaults
(``None``) omitted except the fields without a default (``parent_block_hash``, ``lora_id``).
Block hashes are signed 64-bit integers (SGLang's page hash: first 8 bytes of a SHA-256 chain).
New fields are appended with defaults, so older decoders keep working (msgspec ignores
unknown map keys). tests/unit/engine/test_sglang_wire.py pins this against bytes recorded from
SGLang's own encoder (scripts/record_sglang_kv_events.py).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from engine.backends import kv_frames

#: ``medium`` values (SGLang's ``StorageMedium``): our tiers.
MEDIUM_GPU = "GPU"  # L1
MEDIUM_CPU = "CPU_PINNED"  # L2 (HiCache host tier)
MEDIUM_DISK = "DISK"  # L3: not a tier of ours
MEDIUM_EXTERNAL = "EXTERNAL"  # L4 (e.g. Mooncake store): not a tier of ours
#: medium -> our tier (engine/backends/kvmap.py); DISK and EXTERNAL are none of ours
SGLANG_TIERS = {None: "L1", MEDIUM_GPU: "L1", MEDIUM_CPU: "L2"}


class _KvEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KvEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(_KvEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_KvEvent):
    pass


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 - msgspec reads a Union alias


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KvEvent]
    attn_dp_rank: int | None = None


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENC.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload; raises ``msgspec.DecodeError`` naming the bad field."""
    return _DEC.decode(payload)


def frames(topic: str, seq: int, batch: KVEventBatch) -> list[bytes]:
    """The three ZMQ frames of one message, as SGLang's publisher sends them."""
    return kv_frames.join(topic, seq, encode_batch(batch))


def parse_frames(parts: list[bytes]) -> tuple[str, int, KVEventBatch]:
    """``(topic, seq, batch)`` from one received message (3 frames)."""
    topic, seq, payload = kv_frames.split(parts)
    return topic, seq, decode_batch(payload)


def as_builtins(batch: KVEventBatch) -> Any:
    return msgspec.to_builtins(batch)
