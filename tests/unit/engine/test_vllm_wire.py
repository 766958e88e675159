"""Our decoder of vLLM's KV-event wire format against bytes encoded by vLLM's own classes
(tests/fixtures/vllm/kv_events.json, written by scripts/record_vllm_kv_events.py from vLLM
0.9.2, 0.11.0, 0.26.0, 0.33.0 and a main-branch commit with a map batch; vLLM is never
imported here): every layout (array or map batch, with or without ``data_parallel_rank``;
tagged-array or tagged-map events; int or bytes hashes; each medium) decodes to what vLLM
encoded, and our encoder (the fake server's) writes vLLM 0.33's bytes."""

from __future__ import annotations

import base64
import json
import os

import msgspec
import pytest

from engine.backends.kvmap import PageMap
from engine.backends.vllm.backend import VLLM_TIERS
from engine.backends.vllm.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    parse_frames,
)

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "vllm", "kv_events.json")
with open(FIXTURE) as _fh:
    REC = json.load(_fh)
CASES = REC["cases"]


def ours(batch: KVEventBatch) -> dict:
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
            "events": [{"type": type(e).__name__, **msgspec.to_builtins(msgspec.structs.asdict(e))}
                       for e in batch.events]}


def same(got: dict, want: dict) -> None:
    """``got`` has every field vLLM's class had with its value; the fields that version did not
    have yet are unset (None)."""
    assert (got["ts"], got["data_parallel_rank"]) == (want["ts"], want["data_parallel_rank"])
    assert len(got["events"]) == len(want["events"])
    for g, w in zip(got["events"], want["events"], strict=True):
        assert {k: g[k] for k in w} == w
        assert all(g[k] is None for k in g.keys() - w.keys()), g


def test_the_fixture_covers_every_layout():
    src = REC["sources"]
    assert {(s["batch_array_like"], s["event_array_like"]) for s in src.values()} == {
        (True, True), (True, False), (False, False)}
    payloads = [msgspec.msgpack.decode(base64.b64decode(c["payload"])) for c in CASES.values()]
    assert any(isinstance(p, dict) and "data_parallel_rank" in p for p in payloads)
    assert any(isinstance(p, dict) and "data_parallel_rank" not in p for p in payloads)
    assert any(isinstance(p, list) and p[2] is not None for p in payloads)
    hashes = {type(h) for c in CASES.values() for e in c["expected"]["events"] for h in e.get("block_hashes", [])}
    assert hashes == {int, str}  # ints and bytes (base64 in JSON)
    media = {e.get("medium") for c in CASES.values() for e in c["expected"]["events"]}
    assert {"GPU", "CPU", "STORAGE", "FS", None} <= media


@pytest.mark.parametrize("name", sorted(CASES))
def test_we_decode_vllms_bytes(name):
    same(ours(decode_batch(base64.b64decode(CASES[name]["payload"]))), CASES[name]["expected"])


@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n]["source"] == "0.33.0"))
def test_our_encoder_writes_vllm_033s_bytes(name):
    payload = base64.b64decode(CASES[name]["payload"])
    assert encode_batch(decode_batch(payload)) == payload


@pytest.mark.parametrize("source", sorted(REC["zmq_frames"]))
def test_frames_from_vllms_own_publisher(source):
    rec = REC["zmq_frames"][source]
    topic, seq, batch = parse_frames([base64.b64decode(f) for f in rec["frames"]])
    assert (topic, seq) == ("kv", 0)
    same(ours(batch), rec["expected"])


def test_unknown_fields_ignored_and_bad_payloads_named():
    newer = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU",
                                           "future_field": 3}, ["BlockRemoved", [2], "GPU", 0, "LOCAL", "x", "y"]]])
    assert decode_batch(newer).events == [BlockRemoved(block_hashes=[1], medium="GPU"),
                                          BlockRemoved(block_hashes=[2], medium="GPU", group_idx=0,
                                                       locality="LOCAL", ownership="x")]
    with pytest.raises(msgspec.ValidationError, match="Nope"):
        decode_batch(msgspec.msgpack.encode([1.0, [["Nope", 1]]]))
    with pytest.raises(msgspec.ValidationError, match="type"):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode("nope"))
    with pytest.raises(ValueError, match="frames"):
        parse_frames([b"", b""])


def test_decoded_events_drive_the_page_map_with_vllms_media():
    """int and bytes page hashes chain alike; GPU -> L1, CPU -> L2, storage tiers skipped."""
    pm = PageMap(64, tiers=VLLM_TIERS)
    toks = list(range(128))
    batch = KVEventBatch(ts=0.0, events=[
        BlockStored(block_hashes=[b"a" * 32, 7, b"c" * 32, 9], parent_block_hash=None, token_ids=toks, block_size=32,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockStored(block_hashes=[b"a" * 32, 7], parent_block_hash=None, token_ids=toks[:64], block_size=32,
                    lora_id=None, medium="CPU", lora_name=None),
        BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=toks[:32], block_size=32, lora_id=None,
                    medium="STORAGE", lora_name=None),
    ])
    changes = pm.apply(decode_batch(encode_batch(batch)))
    assert [(c.kind, c.tier, len(c.blocks)) for c in changes] == [("stored", "L1", 2), ("stored", "L2", 1)]
    assert pm.errors["medium_STORAGE"] == 1
    gone = pm.apply(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[9, b"c" * 32], medium="GPU"),
                                                 AllBlocksCleared()]))
    assert [(c.kind, c.tier, len(c.blocks)) for c in gone] == [("evicted", "L1", 1), ("cleared", None, 0)]
