"""Our mirror of SGLang's KV-event wire format against bytes recorded from SGLang's own encoder
(tests/fixtures/sglang/kv_events.json, written by scripts/record_sglang_kv_events.py with
sglang 0.5.23; SGLang is never imported here)."""

from __future__ import annotations

import json
import os

import msgspec
import pytest

from engine.backends.sglang.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    frames,
    parse_frames,
)

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "sglang", "kv_events.json")
with open(FIXTURE) as _fh:
    REC = json.load(_fh)

# the same values the recorder encoded with SGLang's classes
EXPECTED = {
    "stored_gpu": KVEventBatch(ts=1700000000.25, events=[
        BlockStored(block_hashes=[-6917529027641081856], parent_block_hash=None, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium="GPU"),
        BlockStored(block_hashes=[4611686018427387904], parent_block_hash=-6917529027641081856,
                    token_ids=list(range(16, 32)), block_size=16, lora_id=None, medium="GPU"),
    ], attn_dp_rank=0),
    "stored_host_minimal": KVEventBatch(ts=2.5, events=[
        BlockStored(block_hashes=[7], parent_block_hash=3, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
                    medium="CPU_PINNED", cache_salt="salt", session_id="s1"),
    ], attn_dp_rank=1),
    "removed_and_cleared": KVEventBatch(ts=3.0, events=[
        BlockRemoved(block_hashes=[7, -1], medium="GPU"), BlockRemoved(block_hashes=[9]), AllBlocksCleared(),
    ], attn_dp_rank=0),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_our_encoder_writes_sglangs_bytes(name):
    assert encode_batch(EXPECTED[name]).hex() == REC["cases"][name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_we_decode_sglangs_bytes(name):
    assert decode_batch(bytes.fromhex(REC["cases"][name])) == EXPECTED[name]


def test_zmq_frames_match_the_publisher():
    recorded = [bytes.fromhex(f) for f in REC["zmq_frames"]]
    assert frames("kv", 5, EXPECTED["stored_gpu"]) == recorded
    assert parse_frames(recorded) == ("kv", 5, EXPECTED["stored_gpu"])


def test_unknown_fields_are_ignored_and_bad_payloads_named():
    class Newer(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
        block_hashes: list[int]
        future_field: int = 3

    class NewerBatch(msgspec.Struct, array_like=True):
        ts: float
        events: list[Newer]
        attn_dp_rank: int | None = None

    data = msgspec.msgpack.encode(NewerBatch(ts=1.0, events=[Newer(block_hashes=[1])]))
    assert decode_batch(data).events == [BlockRemoved(block_hashes=[1])]
    with pytest.raises(msgspec.DecodeError, match="type"):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]))
    with pytest.raises(ValueError, match="frames"):
        parse_frames([b"", b""])
