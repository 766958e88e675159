"""vLLM's KV-event wire format, mirrored (no vLLM import): what its ``ZmqEventPublisher`` sends
for ``--kv-events-config`` (vllm/distributed/kv_events.py).

One ZMQ message = three frames, as SGLang's: ``topic``, ``seq`` (8-byte big-endian, per
publisher = per DP rank, from 0), ``payload`` = msgpack of ``KVEventBatch``. vLLM has changed
the payload's layout over its releases; every one of them decodes here into the same
:class:`KVEventBatch` of map-form events (tests/unit/engine/test_vllm_wire.py pins each against
bytes encoded by vLLM's own classes, scripts/record_vllm_kv_events.py):

- the batch: a positional array ``[ts, events, data_parallel_rank]`` (``EventBatch(array_like=
  True)`` in 0.9.2, 0.11.0, 0.25.1, 0.26.0 and 0.33.0; the rank nil until the publisher fills it
  in; ``[ts, events]`` is read too), or a map ``{"ts", "events", "data_parallel_rank"?}`` (the
  batch without ``array_like``, seen on vLLM's main branch, the rank omitted while ``None``);
- each event: a *tagged array* ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium?, ...]`` (``KVCacheEvent(array_like=True, tag=True)``, up to 0.11)
  or a *tagged map* ``{"type": "BlockStored", ...}`` (0.25 on). Fields are only ever appended,
  so a tagged array is read by position in the declared order below;
- block hashes: ``int`` (unsigned 64-bit: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``; ints only in
  0.9.2) or ``bytes`` (the SHA-256 block hash, ``ExternalBlockHash = bytes | int`` since 0.11);
- ``medium``: ``GPU``, ``CPU`` (the CPU offloading tier), ``STORAGE`` / ``FS`` / ``OBJ``
  (file-system or object-store tiers), or absent (before 0.11: the GPU cache).

Unknown map keys and extra trailing array fields are ignored (vLLM appends fields with
defaults), so a newer vLLM keeps decoding; an unknown event tag is an error naming it.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from engine.backends import kv_frames

#: ``medium`` values vLLM publishes (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``, 0.26's
#: ``MEDIUM_FS`` / ``MEDIUM_OBJ``); GPU -> L1, CPU -> L2, the rest are not tiers of ours.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

BlockHash = Union[int, bytes]  # noqa: UP007 - msgspec reads a Union alias


class _KvEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KvEvent):
    """vLLM 0.33's fields in its order; those without a default are always encoded."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_KvEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KvEvent):
    pass


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 - msgspec reads a Union alias
_BY_TAG = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
#: fields without a default that vLLM added after 0.9 (absent from older events: None)
_LATE = {BlockStored: ("lora_id", "medium", "lora_name"), BlockRemoved: ("medium",)}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch as vLLM 0.25+ sends it (the fake's encoder); every layout decodes into it."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None

    @property
    def attn_dp_rank(self) -> int | None:  # the name the SGLang page map and backend read
        return self.data_parallel_rank


_ENC = msgspec.msgpack.Encoder()
_FAST = msgspec.msgpack.Decoder(KVEventBatch)  # the current layout: one typed pass
_ANY = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENC.encode(batch)


def _event(raw: Any) -> KvEvent:
    if isinstance(raw, list):  # tagged array: [tag, *fields in declared order]
        if not raw or not isinstance(raw[0], str):
            raise msgspec.ValidationError("KV event array does not start with its type tag")
        cls = _BY_TAG.get(raw[0])
        if cls is None:
            raise msgspec.ValidationError(f"unknown KV event type {raw[0]!r}")
        raw = {"type": raw[0], **dict(zip(cls.__struct_fields__, raw[1:], strict=False))}
    if isinstance(raw, dict):  # a field an older vLLM did not have yet (medium before 0.11, lora_name)
        cls = _BY_TAG.get(raw.get("type"))
        if cls is not None:
            for name in _LATE.get(cls, ()):
                raw.setdefault(name, None)
    return msgspec.convert(raw, KvEvent)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload in any of vLLM's layouts (module docstring); raises
    ``msgspec.DecodeError`` / ``msgspec.ValidationError`` naming what is wrong."""
    try:
        return _FAST.decode(payload)
    except msgspec.ValidationError:
        pass
    raw = _ANY.decode(payload)
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "ts" in raw and "events" in raw:
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise msgspec.ValidationError(f"KV-event batch is neither [ts, events, rank] nor a map: {type(raw).__name__}")
    if not isinstance(events, list):
        raise msgspec.ValidationError("KV-event batch: `events` is not an array")
    return KVEventBatch(ts=msgspec.convert(ts, float), events=[_event(e) for e in events],
                        data_parallel_rank=msgspec.convert(rank, int | None))


def frames(topic: str, seq: int, batch: KVEventBatch) -> list[bytes]:
    """The three ZMQ frames of one message, as vLLM's publisher sends them."""
    return kv_frames.join(topic, seq, encode_batch(batch))


def parse_frames(parts: list[bytes]) -> tuple[str, int, KVEventBatch]:
    """``(topic, seq, batch)`` from one received message (3 frames)."""
    topic, seq, payload = kv_frames.split(parts)
    return topic, seq, decode_batch(payload)


def as_builtins(batch: KVEventBatch) -> Any:
    return msgspec.to_builtins(batch)
