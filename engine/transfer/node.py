"""A stand-alone transfer node: one host pool behind a transfer backend, driven over stdin/stdout.

``python -m engine.transfer.node --backend mooncake --layout bf16:16x4x2x64 --slots 64 --seed 1``
fills its pool with bytes drawn from ``--seed``, registers it and prints one JSON line
``{"descriptor": {...}, "checksums": [...]}``. It then answers one JSON line per command line:

- ``{"op": "read", "peer": DESCRIPTOR, "remote_slots": [...], "local_slots": [...]}``
  (peer fetch into this node) -> ``{"ok": true, "stats": {...}, "checksums": [...local slots]}``
- ``{"op": "write", "local_slots": [...], "peer": DESCRIPTOR, "remote_slots": [...]}`` (P->D)
- ``{"op": "checksums", "slots": [...]}``
- ``{"op": "serve_socket", "slots": [...]}``: the raw-socket baseline of ``evolving bench kv``;
  replies ``{"port": P}``, then sends the slots' bytes to the first connection on that port.
- ``{"op": "quit"}`` (or end of input).

A failed command answers ``{"ok": false, "error": "..."}`` and the node keeps serving. The
integration tests and the transfer benchmark start two of these to have two real processes.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading

import msgspec
import torch

from engine.transfer.base import PoolDescriptor, TransferError
from engine.transfer.exit import exit_process
from engine.transfer.factory import BACKENDS, make_transfer
from kernels.checksum import block_checksums
from kernels.layout import KvLayout, KvLayoutError
from kernels.ops import gather_blocks
from kernels.pool import BlockPool
from services.adapters.logging import configure_logging


def fill(pool: BlockPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    if pool.nbytes % 8 == 0:  # int64 draws are several times faster than uint8 ones
        pool.bytes.view(torch.int64).random_(generator=gen)
    else:
        pool.bytes.copy_(torch.randint(0, 256, pool.bytes.shape, dtype=torch.uint8, generator=gen))


def serve_socket(pool: BlockPool, slots: list[int]) -> int:
    """Listen on a free port; send the slots' bytes (gathered) to the first client, then close."""
    data = gather_blocks(pool, slots)
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(memoryview(data.numpy()))

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1]


def handle(cmd: dict, backend, pool: BlockPool) -> dict:
    op = cmd.get("op")
    if op == "read":
        peer = msgspec.convert(cmd["peer"], PoolDescriptor)
        stats = backend.read_blocks(peer, cmd["remote_slots"], pool, cmd["local_slots"])
        return {
            "ok": True,
            "stats": msgspec.to_builtins(stats),
            "checksums": block_checksums(pool, cmd["local_slots"]),
        }
    if op == "write":
        peer = msgspec.convert(cmd["peer"], PoolDescriptor)
        stats = backend.write_blocks(pool, cmd["local_slots"], peer, cmd["remote_slots"])
        return {"ok": True, "stats": msgspec.to_builtins(stats)}
    if op == "checksums":
        return {"ok": True, "checksums": block_checksums(pool, cmd["slots"])}
    if op == "serve_socket":
        return {"ok": True, "port": serve_socket(pool, cmd["slots"])}
    raise TransferError(f"unknown op {op!r} (read, write, checksums, serve_socket, quit)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.transfer.node", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backend", choices=BACKENDS, default="mooncake")
    parser.add_argument("--host", default="127.0.0.1", help="address the transfer engine listens on")
    parser.add_argument("--layout", default="bf16:16x4x2x64", help="KV layout, dtype:TOKENSxLAYERSxHEADSxDIM")
    parser.add_argument("--slots", type=int, default=64, help="host pool size in blocks")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bytes the pool starts with")
    args = parser.parse_args(argv)
    configure_logging()  # to stderr: stdout carries the JSON replies
    try:
        layout = KvLayout.from_fingerprint(args.layout)
        pool = BlockPool(layout, args.slots)
        fill(pool, args.seed)
        backend = make_transfer(args.backend, host=args.host)
        desc = backend.register_pool(pool, "host")
    except (KvLayoutError, TransferError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    out.write(
        json.dumps(
            {
                "descriptor": msgspec.to_builtins(desc),
                "checksums": block_checksums(pool, list(range(args.slots))),
            }
        )
        + "\n"
    )
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            reply = handle(cmd, backend, pool)
        except (TransferError, KvLayoutError, msgspec.ValidationError, KeyError, ValueError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    backend.close()
    return 0


if __name__ == "__main__":
    exit_process(main())  # engine/transfer/exit.py: Mooncake's teardown can abort
