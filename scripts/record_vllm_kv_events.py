"""Record reference bytes of vLLM's KV-event wire format (run once, by hand; never in CI).

    pip download --no-deps -d /tmp/vllm-wheels vllm==0.9.2 vllm==0.11.0 vllm==0.26.0 vllm==0.33.0
    .venv/bin/python scripts/record_vllm_kv_events.py /tmp/vllm-wheels/*.whl \
        [main-0181ea3=/tmp/vllm-main/vllm/distributed/kv_events.py]

vLLM itself is not installed (its wheel needs CUDA torch): each source, a wheel (its
``vllm/distributed/kv_events.py`` is read from the zip) or ``NAME=PATH`` of that file taken from
vLLM's git history, is executed as the module ``vllm.distributed.kv_events`` in this process,
with stand-ins for the unrelated modules it imports (``vllm.logger``, ``vllm.config``'s
``KVEventsConfig``, ``vllm.utils.network_utils``, ``vllm.v1.core.kv_cache_utils``'s
``ExternalBlockHash``). Fixed ``KVEventBatch`` values of each layout are then encoded with
vLLM's own classes and the encoder its ``ZmqEventPublisher`` uses (``msgspec.msgpack.Encoder()``),
and one batch per source is sent through vLLM's own ``ZmqEventPublisher`` over a real ZMQ
socket, its three frames received here. tests/fixtures/vllm/kv_events.json gets the payloads and
frames (base64) and, per case, the decoded expectation (``msgspec.to_builtins`` of vLLM's own
objects). tests/unit/engine/test_vllm_wire.py pins engine/backends/vllm/wire.py against them.
Nothing of vLLM's code is kept; the bytes are data.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import socket
import sys
import time
import types
import zipfile

import msgspec
import zmq

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "vllm", "kv_events.json")
SRC = "vllm/distributed/kv_events.py"


@dataclasses.dataclass
class KVEventsConfig:  # stand-in: the publisher reads and (0.33) builds one
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _stand_ins() -> None:
    def mod(name: str, **attrs) -> None:
        m = types.ModuleType(name)
        m.__path__ = []
        m.__dict__.update(attrs)
        sys.modules[name] = m

    for pkg in ("vllm", "vllm.distributed", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        mod(pkg)
    mod("vllm.config", KVEventsConfig=KVEventsConfig)  # 0.9: from vllm.config import KVEventsConfig
    mod("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    mod("vllm.logger", init_logger=logging.getLogger)
    mod("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1", get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False, split_zmq_path=lambda p: tuple(p.rsplit(":", 2)))
    mod("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)


def load(name: str, text: str) -> types.ModuleType:
    m = types.ModuleType("vllm.distributed.kv_events")
    m.__file__ = f"<vllm {name}>/{SRC}"
    sys.modules[m.__name__] = m
    exec(compile(text, m.__file__, "exec"), m.__dict__)  # noqa: S102 - vLLM's own module, run to record bytes
    return m


def sources(argv: list[str]) -> dict[str, str]:
    out = {}
    for arg in argv:
        if "=" in arg:
            name, path = arg.split("=", 1)
            with open(path) as fh:
                out[name] = fh.read()
        else:
            version = os.path.basename(arg).split("-")[1]
            with zipfile.ZipFile(arg) as z:
                out[version] = z.read(SRC).decode()
    return out


H1, H2 = 2**64 - 2, 12345  # unsigned 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
B1, B2 = bytes(range(32)), bytes(range(32, 64))  # SHA-256 block hashes (bytes)


def stored(kv, hashes, parent, tokens, size, **kw):
    fields = kv.BlockStored.__struct_fields__
    args = {"block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens, "block_size": size,
            "lora_id": None}
    for k in ("medium", "lora_name"):
        if k in fields:
            args[k] = kw.pop(k, None)
    return kv.BlockStored(**args, **kw)


def removed(kv, hashes, medium=None, **kw):
    if "medium" in kv.BlockRemoved.__struct_fields__:
        kw["medium"] = medium
    return kv.BlockRemoved(block_hashes=hashes, **kw)


def cases(name: str, kv) -> dict:
    B = kv.KVEventBatch
    if name == "0.9.2":  # tagged-array events, int hashes, no medium
        return {
            "v0.9.2_tuple_events_no_rank": B(ts=1700000000.5, events=[
                stored(kv, [H1, H2], None, list(range(32)), 16), removed(kv, [H2]), kv.AllBlocksCleared()]),
            "v0.9.2_tuple_events_rank": B(ts=2.0, events=[stored(kv, [7], H1, [1, 2, 3, 4], 4)],
                                          data_parallel_rank=1),
        }
    if name == "0.11.0":  # tagged-array events with medium, bytes and int hashes
        return {
            "v0.11.0_tuple_events_bytes_gpu": B(ts=3.25, events=[
                stored(kv, [B1, B2], None, list(range(32)), 16, medium="GPU"), removed(kv, [B2], medium="GPU")],
                data_parallel_rank=0),
            "v0.11.0_tuple_events_int_cpu": B(ts=4.0, events=[
                stored(kv, [H2], H1, list(range(16)), 16, medium="CPU"), removed(kv, [H2], medium="CPU")]),
        }
    if name.startswith("main-"):  # map batch (EventBatch without array_like), tagged-map events
        return {
            f"{name}_map_batch_rank": B(ts=5.5, events=[
                stored(kv, [B1], None, list(range(16)), 16, medium="GPU", group_idx=0,
                       kv_cache_spec_kind="full_attention"), removed(kv, [B1], medium="GPU", group_idx=0)],
                data_parallel_rank=2),
            f"{name}_map_batch_no_rank": B(ts=6.0, events=[kv.AllBlocksCleared()]),
        }
    if name == "0.26.0":
        return {"v0.26.0_map_events_fs": B(ts=6.5, events=[
            stored(kv, [H1], None, list(range(16)), 16, medium="FS"), removed(kv, [H1], medium="FS")],
            data_parallel_rank=0)}
    if name == "0.33.0":  # tagged-map events in an array batch: what vLLM sends today
        return {
            "v0.33.0_map_events_gpu_bytes": B(ts=1800000000.125, events=[
                stored(kv, [B1, B2], None, list(range(32)), 16, medium="GPU", extra_keys=[None, None], group_idx=0,
                       kv_cache_spec_kind="full_attention"),
                removed(kv, [B2], medium="GPU", group_idx=0)], data_parallel_rank=0),
            "v0.33.0_map_events_cpu_storage_int": B(ts=7.0, events=[
                stored(kv, [H1], None, list(range(16)), 16, medium="CPU", session_id="s1"),
                stored(kv, [H2], H1, list(range(16, 32)), 16, medium="STORAGE"),
                removed(kv, [H1], medium="CPU"), removed(kv, [H2], medium="STORAGE"), kv.AllBlocksCleared()],
                data_parallel_rank=3),
            "v0.33.0_no_rank_plain": B(ts=8.0, events=[stored(kv, [H2], None, [5, 6], 2, medium="GPU")]),
        }
    raise SystemExit(f"no cases for source {name!r}")


def expected(batch) -> dict:
    events = []
    for e in batch.events:
        d = {"type": type(e).__name__}
        d.update(msgspec.to_builtins(msgspec.structs.asdict(e)))
        events.append(d)
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def through_publisher(kv, batch, topic: str = "kv") -> list[bytes]:
    """One batch sent by vLLM's own ZmqEventPublisher, received on a SUB socket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic=topic)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    time.sleep(0.5)  # ZMQ slow joiner
    try:
        pub.publish(batch)
        return sub.recv_multipart()
    finally:
        sub.close(linger=0)
        pub.shutdown()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    _stand_ins()
    enc = msgspec.msgpack.Encoder()
    out = {"about": "vLLM KV-event payloads encoded by vLLM's own classes (vllm/distributed/kv_events.py of each "
                    "source below) with msgspec.msgpack.Encoder(), as its ZmqEventPublisher does; written by "
                    "scripts/record_vllm_kv_events.py",
           "msgspec_version": msgspec.__version__, "sources": {}, "cases": {}, "zmq_frames": {}}
    for name, text in sources(argv).items():
        kv = load(name, text)
        out["sources"][name] = {
            "batch_array_like": kv.EventBatch.__struct_config__.array_like,
            "event_array_like": kv.KVCacheEvent.__struct_config__.array_like,
            "block_stored_fields": list(kv.BlockStored.__struct_fields__),
        }
        for case, batch in cases(name, kv).items():
            out["cases"][case] = {"source": name, "payload": b64(enc.encode(batch)), "expected": expected(batch)}
        parts = []
        if hasattr(kv, "ZmqEventPublisher"):  # a source file cut to its structs has no publisher
            parts = through_publisher(kv, next(iter(cases(name, kv).values())))
            out["zmq_frames"][name] = {"frames": [b64(p) for p in parts], "expected": expected(
                msgspec.msgpack.decode(parts[2], type=kv.KVEventBatch))}
        print(f"{name}: {len(cases(name, kv))} cases, frames {[len(p) for p in parts]}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
