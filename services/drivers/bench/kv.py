"""``evolving bench kv``: KV block movement bandwidth, ours against plain torch, side by side.

Each figure is GiB/s of block bytes moved, best of ``repeats`` timed runs after one warm-up:

- gather / scatter: ``kernels.ops`` (int64-row index kernels; Triton too on CUDA) against a
  plain ``torch.index_select`` / ``index_copy_`` on the model's typed view.
- host copy: ``copy_blocks`` between a device pool and the (pinned) host pool against the naive
  ``host[idx] = dev[idx].cpu()``; on the CPU, pool to pool against the same plain ops.
- limit: one contiguous ``copy_`` of the same bytes (memcpy on the CPU; device-to-device and
  pinned host<->device on a GPU): what no kernel can beat.
- transfer: a Mooncake TCP read of the same blocks from a peer process against a raw socket
  copy of the same bytes from that process (``engine.transfer.node``), both ending in the
  local pool. Skipped, with the reason, where Mooncake does not import.

Every timed path is checked against the loop reference or the baseline's bytes before it is
reported: a wrong fast path fails the benchmark instead of winning it.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from kernels import ops, ref
from kernels.checksum import block_checksums
from kernels.layout import KvLayout
from kernels.pool import BlockPool

GIB = float(1 << 30)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    return _race(device, repeats, only=fn)["only"]


def _race(device: torch.device, repeats: int, **fns: Callable[[], object]) -> dict[str, float]:
    """Best time of each function over ``repeats`` rounds that run them in turn (after one
    warm-up each), so a busy neighbour slows every contender alike rather than one of them."""
    for fn in fns.values():
        fn()
    _sync(device)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _figure(nbytes: int, ours_s: float, base_s: float, limit_s: float | None = None, **extra) -> dict:
    out = {
        "bytes": nbytes,
        "ours_gib_s": _sig(nbytes / ours_s / GIB),
        "baseline_gib_s": _sig(nbytes / base_s / GIB),
        "speedup": _sig(base_s / ours_s),
    }
    if limit_s is not None:
        out["limit_gib_s"] = _sig(nbytes / limit_s / GIB)
        out["share_of_limit"] = _sig(limit_s / ours_s)
    out.update(extra)
    return out


def _filled(layout: KvLayout, num_slots: int, device: torch.device, seed: int) -> BlockPool:
    pool = BlockPool(layout, num_slots, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    pool.bytes.view(-1)[: pool.nbytes // 8 * 8].view(torch.int64).random_(generator=gen)  # cheap random bytes
    return pool


def _baseline_view(pool: BlockPool) -> torch.Tensor:
    """The model's typed view for the plain-torch baseline; torch has no index kernels for fp8,
    so there a plain user falls back to the same shape in uint8 (the bytes of each element)."""
    typed = pool.typed()
    try:
        torch.index_select(typed[:1], 0, torch.zeros(1, dtype=torch.int64, device=typed.device))
        typed[:1].index_copy_(0, torch.zeros(1, dtype=torch.int64, device=typed.device), typed[:1].clone())
    except (NotImplementedError, RuntimeError):
        shape = pool.layout.block_shape
        return pool.bytes.view(pool.num_slots, *shape[:-1], shape[-1] * pool.layout.elem_bytes)
    return typed


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"bench kv: {what} moved different bytes than the reference")


def bench_kernels(
    layout: KvLayout, num_slots: int, blocks: int, device: torch.device, repeats: int, seed: int
) -> dict:
    rng = random.Random(seed)
    slots = rng.sample(range(num_slots), blocks)
    dst_slots = rng.sample(range(num_slots), blocks)
    nbytes = blocks * layout.block_bytes
    pool = _filled(layout, num_slots, device, seed)
    idx = torch.tensor(slots, device=device)
    typed = _baseline_view(pool)
    staging = torch.empty((blocks, layout.block_bytes), dtype=torch.uint8, device=device)
    flat_src = pool.words().view(-1)[: nbytes // pool.words().element_size()]
    flat_dst = staging.view(pool.words().dtype).view(-1)
    impls = ["torch"]
    if device.type == "cuda":
        from kernels import triton_ops  # lazy: optional dependency (triton, CUDA only)

        if triton_ops.HAVE_TRITON:
            impls.append("triton")
    result: dict = {}

    # gather
    want = ref.ref_gather(pool, slots)
    fns = {impl: (lambda impl=impl: ops.gather_blocks(pool, slots, staging, impl=impl)) for impl in impls}
    t = _race(
        device,
        repeats,
        limit=lambda: flat_dst.copy_(flat_src),
        baseline=lambda: torch.index_select(typed, 0, idx),
        **fns,
    )
    for impl in impls:
        ops.gather_blocks(pool, slots, staging, impl=impl)
        _check(torch.equal(staging.cpu(), want), f"gather ({impl})")
        result[f"gather[{impl}]"] = _figure(nbytes, t[impl], t["baseline"], t["limit"])

    # scatter (the same rows written into other slots)
    src_rows = want.to(device)
    typed_rows = src_rows.view(typed.dtype).view(blocks, *typed.shape[1:])
    didx = torch.tensor(dst_slots, device=device)
    fns = {
        impl: (lambda impl=impl: ops.scatter_blocks(pool, dst_slots, src_rows, impl=impl)) for impl in impls
    }
    t = _race(
        device,
        repeats,
        limit=lambda: flat_dst.copy_(flat_src),
        baseline=lambda: typed.index_copy_(0, didx, typed_rows),
        **fns,
    )
    for impl in impls:
        pool.bytes[dst_slots[0]].zero_()
        ops.scatter_blocks(pool, dst_slots, src_rows, impl=impl)
        _check(torch.equal(ops.gather_blocks(pool, dst_slots).cpu(), want), f"scatter ({impl})")
        result[f"scatter[{impl}]"] = _figure(nbytes, t[impl], t["baseline"], t["limit"])
    result.update(_bench_host_copy(layout, num_slots, pool, slots, dst_slots, device, repeats, seed))
    return result


def _bench_host_copy(layout, num_slots, pool, slots, dst_slots, device, repeats, seed) -> dict:
    blocks = len(slots)
    nbytes = blocks * layout.block_bytes
    host = _filled(layout, num_slots, torch.device("cpu"), seed + 1)  # pinned when CUDA is present
    idx, didx = torch.tensor(slots, device=device), torch.tensor(dst_slots)
    htyped, dtyped = _baseline_view(host), _baseline_view(pool)
    out: dict = {}
    if device.type == "cuda":
        flat_dev = pool.bytes.view(-1)[:nbytes]
        flat_host = host.bytes.view(-1)[:nbytes]

        def naive_down() -> None:
            htyped[didx] = dtyped[idx].cpu()

        t = _race(
            device,
            repeats,
            limit=lambda: flat_host.copy_(flat_dev, non_blocking=True),
            baseline=naive_down,
            ours=lambda: ops.copy_blocks(pool, slots, host, dst_slots).wait(),
        )
        host.bytes.index_fill_(0, didx, 0)  # so the check sees this copy
        h = ops.copy_blocks(pool, slots, host, dst_slots)
        h.wait()
        _check(block_checksums(host, dst_slots) == block_checksums(pool, slots), "device->host copy")
        out["host_copy[device->host]"] = _figure(nbytes, t["ours"], t["baseline"], t["limit"], runs=h.runs)

        def naive_up() -> None:
            dtyped[idx] = htyped[didx].to(device)

        t = _race(
            device,
            repeats,
            limit=lambda: flat_dev.copy_(flat_host, non_blocking=True),
            baseline=naive_up,
            ours=lambda: ops.copy_blocks(host, dst_slots, pool, slots).wait(),
        )
        pool.bytes.index_fill_(0, idx, 0)
        ops.copy_blocks(host, dst_slots, pool, slots).wait()
        _check(block_checksums(pool, slots) == block_checksums(host, dst_slots), "host->device copy")
        out["host_copy[host->device]"] = _figure(nbytes, t["ours"], t["baseline"], t["limit"])

        out.update(_bench_broadcast(layout, num_slots, host, dst_slots, slots, repeats))
    else:
        words = nbytes // pool.words().element_size()
        flat_a, flat_b = pool.words().view(-1)[:words], host.words().view(-1)[:words]
        t = _race(
            device,
            repeats,
            limit=lambda: flat_b.copy_(flat_a),
            baseline=lambda: htyped.index_copy_(0, didx, torch.index_select(dtyped, 0, idx)),
            ours=lambda: ops.copy_blocks(pool, slots, host, dst_slots).wait(),
        )
        host.bytes.zero_()
        h = ops.copy_blocks(pool, slots, host, dst_slots)
        _check(block_checksums(host, dst_slots) == block_checksums(pool, slots), "pool->pool copy")
        out["host_copy[pool->pool]"] = _figure(nbytes, t["ours"], t["baseline"], t["limit"], runs=h.runs)
    return out


def _bench_broadcast(layout, num_slots, host, host_slots, slots, repeats) -> dict:
    """One pinned host copy into every visible GPU at once, against one GPU after the other."""
    n_dev = torch.cuda.device_count()
    if n_dev < 2:
        return {"broadcast": f"skipped: {n_dev} GPU visible (needs 2 or more)"}
    pools = [BlockPool(layout, num_slots, torch.device("cuda", i)) for i in range(n_dev)]
    targets = [(p, slots) for p in pools]
    hidx = torch.tensor(host_slots)

    def one_by_one() -> None:
        for p in pools:
            _baseline_view(p)[torch.tensor(slots, device=p.device)] = _baseline_view(host)[hidx].to(p.device)

    def ours() -> None:
        for h in ops.broadcast_blocks(host, host_slots, targets):
            h.wait()

    t = _race(torch.device("cuda"), repeats, baseline=one_by_one, ours=ours)
    for i in range(n_dev):
        torch.cuda.synchronize(i)
    want = block_checksums(host, host_slots)
    _check(all(block_checksums(p, slots) == want for p in pools), "broadcast")
    return {
        f"broadcast[{n_dev} GPUs]": _figure(n_dev * len(slots) * layout.block_bytes, t["ours"], t["baseline"])
    }


def bench_transfer(layout: KvLayout, blocks: int, repeats: int, seed: int) -> dict:
    """Mooncake TCP read from a peer process against a raw socket copy from the same process."""
    try:
        from engine.transfer.mooncake import (  # lazy: optional (bare GPU box)
            MooncakeTransfer,
            mooncake_available,
        )
    except ImportError as exc:  # engine deps (msgspec, structlog) missing, e.g. on a bare GPU box
        return {"skipped": f"engine.transfer does not import: {exc}"}
    ok, why = mooncake_available()
    if not ok:
        return {"skipped": why}
    from engine.transfer.base import PoolDescriptor  # lazy: optional (engine deps, as above)

    num_slots = blocks + blocks // 2
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.transfer.node",
            "--backend",
            "mooncake",
            "--layout",
            layout.fingerprint(),
            "--slots",
            str(num_slots),
            "--seed",
            str(seed),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )

    def ask(**cmd) -> dict:
        peer.stdin.write(json.dumps(cmd) + "\n")
        peer.stdin.flush()
        return json.loads(peer.stdout.readline())

    local = BlockPool(layout, num_slots)
    backend = MooncakeTransfer()
    try:
        hello = json.loads(peer.stdout.readline())
        desc = PoolDescriptor(**hello["descriptor"])
        backend.register_pool(local)
        rng = random.Random(seed)
        remote_slots = rng.sample(range(num_slots), blocks)
        local_slots = list(range(blocks))
        nbytes = blocks * layout.block_bytes
        staging = torch.empty((blocks, layout.block_bytes), dtype=torch.uint8)

        def raw_socket() -> None:
            port = ask(op="serve_socket", slots=remote_slots)["port"]
            view = memoryview(staging.numpy()).cast("B")
            got = 0
            with socket.create_connection(("127.0.0.1", port)) as conn:
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if n == 0:
                        raise ConnectionError("raw socket baseline: peer closed early")
                    got += n
            ops.scatter_blocks(local, local_slots, staging)

        cpu = torch.device("cpu")
        base_s = _best_s(raw_socket, cpu, repeats)
        want = [hello["checksums"][s] for s in remote_slots]
        _check(block_checksums(local, local_slots) == want, "raw socket")
        ours_s = _best_s(lambda: backend.read_blocks(desc, remote_slots, local, local_slots), cpu, repeats)
        local.bytes.zero_()
        stats = backend.read_blocks(desc, remote_slots, local, local_slots)
        _check(block_checksums(local, local_slots) == want, "mooncake read")
        # The raw socket figure includes the peer's gather and one request round trip, as a real
        # fetch would; Mooncake reads the scattered slots in place.
        return {"mooncake_tcp_read": _figure(nbytes, ours_s, base_s, runs=stats.runs, baseline="raw socket")}
    finally:
        backend.close()
        if peer.poll() is None:  # the peer holds nothing worth a clean Mooncake teardown (~1 s)
            peer.terminate()
            peer.wait()


def run(
    *,
    device: str = "cpu",
    layout: str = "bf16:16x64x8x128",
    num_slots: int = 64,
    blocks: int = 24,
    repeats: int = 5,
    seed: int = 0,
    transfer: bool = True,
    transfer_blocks: int = 16,
) -> dict:
    dev = torch.device(device)
    kv = KvLayout.from_fingerprint(layout)
    if blocks > num_slots:
        raise ValueError(f"--blocks {blocks} is more than --slots {num_slots}")
    result = {
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "layout": kv.fingerprint(),
        "block_bytes": kv.block_bytes,
        "blocks_moved": blocks,
        "kernels": bench_kernels(kv, num_slots, blocks, dev, repeats, seed),
    }
    if transfer:
        result["transfer"] = bench_transfer(kv, transfer_blocks, max(1, repeats // 2), seed)
    return result


def format_report(result: dict) -> str:
    lines = [
        (
            f"KV block movement on {result['device']} (torch {result['torch']}, {result['threads']} threads), "
            f"layout {result['layout']} = {result['block_bytes'] / 1024:.0f} KiB/block, "
            f"{result['blocks_moved']} random blocks per call"
        ),
        f"{'path':28} {'ours GiB/s':>11} {'baseline':>10} {'speedup':>8} {'limit':>8} {'of limit':>9}",
    ]
    rows = list(result["kernels"].items()) + list(result.get("transfer", {}).items())
    for name, fig in rows:
        if not isinstance(fig, dict):
            lines.append(f"{name:28} skipped: {fig}")
            continue
        limit = f"{fig['limit_gib_s']:8.2f}" if "limit_gib_s" in fig else f"{'-':>8}"
        share = f"{fig['share_of_limit']:9.0%}" if "share_of_limit" in fig else f"{'-':>9}"
        lines.append(
            f"{name:28} {fig['ours_gib_s']:11.2f} {fig['baseline_gib_s']:10.2f} "
            f"{fig['speedup']:7.2f}x {limit} {share}"
        )
    lines.append(
        "baseline: torch.index_select/index_copy_ on the typed view (gather/scatter/pool copy), "
        "host[idx] = dev[idx].cpu() (host copy on a GPU), raw socket (transfer); "
        "limit: one contiguous copy_ of the same bytes"
    )
    return "\n".join(lines)

