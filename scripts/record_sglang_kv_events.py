"""Record reference bytes of SGLang's KV-event wire format (run once, by hand; never in CI).

    bash ../shared/tools/sglang-cpu/setup.sh /tmp/sgl
    PYTHONPATH=../shared/tools/sglang-cpu /tmp/sgl/v/bin/python scripts/record_sglang_kv_events.py

Encodes fixed ``KVEventBatch`` values with SGLang's own classes (sglang.srt.disaggregation.kv_events)
and the encoder its ``ZmqEventPublisher`` uses (``msgspec.msgpack.Encoder()``), and writes the
payloads plus the three ZMQ frames of one message (topic, 8-byte big-endian sequence, payload)
to tests/fixtures/sglang/kv_events.json (hex). tests/unit/engine/test_sglang_wire.py pins our
encoder and decoder (engine/backends/sglang/wire.py) against these bytes.
"""

from __future__ import annotations

import json
import os

import msgspec
import sglang
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    StorageMedium,
)

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "sglang", "kv_events.json")


def cases() -> dict[str, KVEventBatch]:
    return {
        "stored_gpu": KVEventBatch(ts=1700000000.25, events=[
            BlockStored(block_hashes=[-6917529027641081856], parent_block_hash=None, token_ids=list(range(16)),
                        block_size=16, lora_id=None, medium=StorageMedium.GPU),
            BlockStored(block_hashes=[4611686018427387904], parent_block_hash=-6917529027641081856,
                        token_ids=list(range(16, 32)), block_size=16, lora_id=None, medium=StorageMedium.GPU),
        ], attn_dp_rank=0),
        "stored_host_minimal": KVEventBatch(ts=2.5, events=[
            BlockStored(block_hashes=[7], parent_block_hash=3, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
                        medium=StorageMedium.CPU, cache_salt="salt", session_id="s1"),
        ], attn_dp_rank=1),
        "removed_and_cleared": KVEventBatch(ts=3.0, events=[
            BlockRemoved(block_hashes=[7, -1], medium=StorageMedium.GPU),
            BlockRemoved(block_hashes=[9]),
            AllBlocksCleared(),
        ], attn_dp_rank=0),
    }


def main() -> None:
    enc = msgspec.msgpack.Encoder()
    out = {"sglang_version": sglang.__version__, "encoder": "msgspec.msgpack.Encoder()", "cases": {}}
    for name, batch in cases().items():
        out["cases"][name] = enc.encode(batch).hex()
    # one ZMQ message as ZmqEventPublisher sends it: (topic, seq as 8 big-endian bytes, payload)
    out["zmq_frames"] = [b"kv".hex(), (5).to_bytes(8, "big").hex(), out["cases"]["stored_gpu"]]
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"wrote {os.path.normpath(OUT)} (sglang {sglang.__version__})")


if __name__ == "__main__":
    main()
