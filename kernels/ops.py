"""Fast KV block movement on byte-backed pools (torch ops; a Triton kernel on CUDA when asked).

- ``gather_blocks``: pool slots -> a contiguous staging buffer ``[n, block_bytes]``.
- ``scatter_blocks``: a staging buffer -> pool slots (each slot written once per call).
- ``copy_blocks``: slots of one pool -> slots of another, same or different device. Between a
  GPU and a (pinned) host pool it runs on a side stream of the GPU and returns at once; the
  returned ``CopyHandle`` says when the bytes have landed (``done()`` polls, ``wait()`` blocks,
  ``wait_on(stream)`` makes a stream wait without blocking the host). On the CPU every call
  completes before it returns and its handle is already done: same API, no asynchrony.
- ``broadcast_blocks``: one host copy read by several device pools (one copy per node).

All of them index rows as the widest integer type that divides a block (``BlockPool.words``):
that, not the KV dtype, decides how fast torch's index kernels are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kernels.layout import KvLayoutError, check_slots, coalesce_runs
from kernels.pool import BlockPool

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class CopyHandle:
    """Completion of one asynchronous block copy. Holds the tensors it uses until dropped."""

    def __init__(
        self, *, event: torch.cuda.Event | None = None, keep: tuple = (), nbytes: int = 0, runs: int = 0
    ) -> None:
        self._event = event
        self._keep = keep
        self.nbytes = nbytes
        self.runs = runs

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block the calling thread until the bytes are in place."""
        if self._event is not None:
            self._event.synchronize()

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream``'s later work wait for this copy (no host blocking)."""
        if self._event is not None:
            stream.wait_event(self._event)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of a CUDA device (one per device, created on first use)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def as_slots(slots: Iterable[int] | torch.Tensor, what: str) -> list[int]:
    if isinstance(slots, torch.Tensor):
        return [int(s) for s in slots.tolist()]
    try:
        return [int(s) for s in slots]
    except (TypeError, ValueError) as exc:
        raise KvLayoutError(f"{what}: slots must be integers, got {slots!r}") from exc


def _rows(t: torch.Tensor, n: int, pool: BlockPool, what: str) -> torch.Tensor:
    """``t`` as ``[n, block_bytes]`` uint8 rows on the pool's device (a view, never a copy)."""
    if t.device != pool.device:
        raise KvLayoutError(f"{what}: buffer is on {t.device}, pool on {pool.device}")
    if not t.is_contiguous() or t.numel() * t.element_size() != n * pool.block_bytes:
        raise KvLayoutError(
            f"{what}: buffer must be contiguous with {n} x {pool.block_bytes} bytes, "
            f"got {t.dtype} {tuple(t.shape)}"
        )
    return t.view(torch.uint8).reshape(n, pool.block_bytes)


def _index(slots: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64, device=device)


def _use_triton(impl: str, device: torch.device) -> bool:
    if impl == "torch":
        return False
    if impl != "triton":
        raise KvLayoutError(f"impl must be 'torch' or 'triton', got {impl!r}")
    from kernels import triton_ops  # lazy: triton is optional and slow to import; only impl='triton' needs it

    if not triton_ops.HAVE_TRITON or device.type != "cuda":
        raise KvLayoutError(f"impl='triton' needs triton and a CUDA pool (pool on {device})")
    return True


def gather_blocks(
    pool: BlockPool, slots: Iterable[int], out: torch.Tensor | None = None, *, impl: str = "torch"
) -> torch.Tensor:
    """Copy ``slots`` of ``pool`` into ``out`` (``[n, block_bytes]`` uint8, allocated if None)."""
    slots = as_slots(slots, "gather_blocks")
    check_slots(slots, pool.num_slots, "gather_blocks", unique=False)
    n = len(slots)
    if out is None:
        out = torch.empty((n, pool.block_bytes), dtype=torch.uint8, device=pool.device)
    rows = _rows(out, n, pool, "gather_blocks out")
    if n == 0:
        return out
    words = pool.words()
    idx = _index(slots, pool.device)
    if _use_triton(impl, pool.device):
        from kernels.triton_ops import copy_rows  # lazy: triton, optional (impl='triton' only)

        copy_rows(words, idx, rows.view(words.dtype), torch.arange(n, device=pool.device))
    else:
        torch.index_select(words, 0, idx, out=rows.view(words.dtype))
    return out


def scatter_blocks(
    pool: BlockPool, slots: Iterable[int], staging: torch.Tensor, *, impl: str = "torch"
) -> None:
    """Write row ``i`` of ``staging`` into slot ``slots[i]`` of ``pool``."""
    slots = as_slots(slots, "scatter_blocks")
    check_slots(slots, pool.num_slots, "scatter_blocks", unique=True)
    n = len(slots)
    rows = _rows(staging, n, pool, "scatter_blocks staging")
    if n == 0:
        return
    words = pool.words()
    idx = _index(slots, pool.device)
    if _use_triton(impl, pool.device):
        from kernels.triton_ops import copy_rows  # lazy: triton, optional (impl='triton' only)

        copy_rows(rows.view(words.dtype), torch.arange(n, device=pool.device), words, idx)
    else:
        words.index_copy_(0, idx, rows.view(words.dtype))


def _check_pair(src: BlockPool, src_slots: list[int], dst: BlockPool, dst_slots: list[int]) -> None:
    if src.layout != dst.layout:
        raise KvLayoutError(
            f"copy_blocks: layouts differ ({src.layout.fingerprint()} -> {dst.layout.fingerprint()})"
        )
    if len(src_slots) != len(dst_slots):
        raise KvLayoutError(f"copy_blocks: {len(src_slots)} source slots but {len(dst_slots)} target slots")
    check_slots(src_slots, src.num_slots, "copy_blocks source", unique=False)
    check_slots(dst_slots, dst.num_slots, "copy_blocks target", unique=True)


def copy_blocks(
    src: BlockPool,
    src_slots: Iterable[int],
    dst: BlockPool,
    dst_slots: Iterable[int],
    *,
    stream: torch.cuda.Stream | None = None,
    impl: str = "torch",
) -> CopyHandle:
    """Copy ``src_slots`` of ``src`` into ``dst_slots`` of ``dst``; see the module docstring.

    Same device: one copy per run of consecutive slots when runs are large
    (``RUN_COPY_MIN_BYTES``), else one gather and one scatter (a fused Triton kernel with
    ``impl='triton'``).
    Across devices: one non-blocking copy per run of consecutive slots (``coalesce_runs``), on
    ``stream`` or the side stream of the GPU involved, after the work already queued on that
    GPU's current stream (so a copy never reads a block a kernel is still writing).
    """
    src_slots = as_slots(src_slots, "copy_blocks source")
    dst_slots = as_slots(dst_slots, "copy_blocks target")
    _check_pair(src, src_slots, dst, dst_slots)
    nbytes = len(src_slots) * src.block_bytes
    cuda_dev = next((p.device for p in (src, dst) if p.device.type == "cuda"), None)
    if not src_slots:
        return CopyHandle()
    if cuda_dev is None:  # host to host: synchronous
        if src.device != dst.device:
            raise KvLayoutError(f"copy_blocks: no path from {src.device} to {dst.device}")
        _same_device_copy(src, src_slots, dst, dst_slots, impl)
        return CopyHandle(nbytes=nbytes, runs=1)
    side = stream if stream is not None else side_stream(cuda_dev)
    side.wait_stream(torch.cuda.current_stream(cuda_dev))
    with torch.cuda.stream(side):
        if src.device == dst.device:
            _same_device_copy(src, src_slots, dst, dst_slots, impl)
            runs = 1
        else:
            plan = coalesce_runs(src_slots, dst_slots)
            for s, d, n in plan:
                dst.bytes[d : d + n].copy_(src.bytes[s : s + n], non_blocking=True)
            runs = len(plan)
        event = torch.cuda.Event()
        event.record(side)
    return CopyHandle(event=event, keep=(src, dst), nbytes=nbytes, runs=runs)


#: Average bytes per run of consecutive slots above which two distinct pools on one device copy
#: run by run (one memcpy each, no staging tensor) instead of through index kernels.
RUN_COPY_MIN_BYTES = 256 * 1024


def _same_device_copy(
    src: BlockPool, src_slots: list[int], dst: BlockPool, dst_slots: list[int], impl: str
) -> None:
    if impl == "torch" and src is not dst:
        runs = coalesce_runs(src_slots, dst_slots)
        if len(src_slots) * src.block_bytes >= RUN_COPY_MIN_BYTES * len(runs):
            sw, dw = src.words(), dst.words()
            for s, d, n in runs:
                dw[d : d + n].copy_(sw[s : s + n])
            return
    src_idx = _index(src_slots, src.device)
    dst_idx = _index(dst_slots, dst.device)
    if _use_triton(impl, src.device):
        from kernels.triton_ops import copy_rows  # lazy: triton, optional (impl='triton' only)

        if src is dst and set(src_slots) & set(dst_slots):
            raise KvLayoutError("copy_blocks impl='triton': source and target slots overlap in one pool")
        copy_rows(src.words(), src_idx, dst.words(), dst_idx)
        return
    # The gathered rows are a new tensor, so overlapping slots in one pool read the old bytes.
    dst.words().index_copy_(0, dst_idx, torch.index_select(src.words(), 0, src_idx))


def broadcast_blocks(
    src: BlockPool,
    src_slots: Iterable[int],
    targets: Sequence[tuple[BlockPool, Iterable[int]]],
) -> list[CopyHandle]:
    """Copy the same ``src`` blocks into several pools (typically one host copy -> each GPU).

    The host keeps one copy; each target reads it on its own device's side stream, so the
    copies to different GPUs overlap. Returns one handle per target, in order.
    """
    src_slots = as_slots(src_slots, "broadcast_blocks source")
    devices = [dst.device for dst, _ in targets]
    if len(set(devices)) != len(devices) and any(d.type == "cuda" for d in devices):
        raise KvLayoutError("broadcast_blocks: two targets on one GPU (keep one pool per device)")
    return [copy_blocks(src, src_slots, dst, dst_slots) for dst, dst_slots in targets]
