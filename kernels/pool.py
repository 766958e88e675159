"""Byte-backed block pools and a slot allocator.

A ``BlockPool`` is one tensor ``[num_slots, block_bytes]`` of ``uint8`` on one device. Every
kernel moves whole rows of it; ``typed()`` gives the model's view
``[num_slots, block_tokens, layers, heads, head_dim]`` of the same memory. A host pool is
pinned when CUDA is present, so device copies to and from it are real asynchronous DMA.

A KV pool maps its block ids to slots with a ``SlotAllocator`` (lowest free slot first, so the
same sequence of calls gives the same slots) and keeps ``block id -> slot`` itself.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from kernels.layout import KvLayout, KvLayoutError

_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": getattr(torch, "float8_e4m3fn", torch.uint8),
    "fp8_e5m2": getattr(torch, "float8_e5m2", torch.uint8),
}


def torch_dtype(layout: KvLayout) -> torch.dtype:
    return _TORCH_DTYPES[layout.dtype]


def word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer type that divides a row: torch's CPU index kernels are up to 25x
    faster on int64 rows than on uint8 or bf16 rows of the same bytes (see docs/kernels.md)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return dtype
    return torch.uint8


class BlockPool:
    """``num_slots`` KV blocks of ``layout`` as bytes on ``device``."""

    def __init__(
        self,
        layout: KvLayout,
        num_slots: int,
        device: str | torch.device = "cpu",
        *,
        pin: bool | None = None,
        data: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise KvLayoutError(f"BlockPool num_slots must be a positive int, got {num_slots!r}")
        self.layout = layout
        self.num_slots = num_slots
        shape = (num_slots, layout.block_bytes)
        if data is not None:
            if data.dtype != torch.uint8 or tuple(data.shape) != shape or not data.is_contiguous():
                raise KvLayoutError(
                    f"BlockPool data must be contiguous uint8 {shape}, got {data.dtype} {tuple(data.shape)}"
                )
            self.bytes = data
        else:
            dev = torch.device(device)
            if pin is None:
                pin = dev.type == "cpu" and torch.cuda.is_available()
            self.bytes = torch.zeros(shape, dtype=torch.uint8, device=dev, pin_memory=bool(pin))

    @property
    def device(self) -> torch.device:
        return self.bytes.device

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.layout.block_bytes

    @property
    def is_pinned(self) -> bool:
        return self.device.type == "cpu" and self.bytes.is_pinned()

    def data_ptr(self) -> int:
        return self.bytes.data_ptr()

    def slot_addr(self, slot: int) -> int:
        """Address of a slot's first byte (what RDMA/TCP transfer engines are given)."""
        return self.data_ptr() + slot * self.layout.block_bytes

    def poison(self, slots: Sequence[int]) -> None:
        """Fill ``slots`` with 0xFF bytes (NaN in every float dtype): a receiver does this to the
        slots a transfer will land in, so bytes left there by an earlier transfer of the same
        blocks (slots are handed out lowest first) cannot pass a short transfer's checksums."""
        if not slots:
            return
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.device)
        self.bytes.index_fill_(0, idx, 0xFF)
        if self.device.type == "cuda":  # a transfer engine reads the raw memory next, off torch's stream
            torch.cuda.current_stream(self.device).synchronize()

    def typed(self) -> torch.Tensor:
        """The model's view ``[num_slots, block_tokens, layers, heads, head_dim]`` (no copy)."""
        return self.bytes.view(torch_dtype(self.layout)).view(self.num_slots, *self.layout.block_shape)

    def words(self) -> torch.Tensor:
        """The same bytes as rows of the widest integer type (what the fast kernels index)."""
        return self.bytes.view(word_dtype(self.layout.block_bytes))

    def __repr__(self) -> str:
        pinned = " pinned" if self.is_pinned else ""
        return f"BlockPool({self.layout.fingerprint()}, {self.num_slots} slots, {self.device}{pinned})"


def host_pool(layout: KvLayout, num_slots: int) -> BlockPool:
    """The node's host pool: pinned when CUDA is present (one copy per node, all GPUs read it)."""
    return BlockPool(layout, num_slots, "cpu")


class SlotAllocator:
    """Free slots of a pool. ``alloc`` hands out the lowest free slots (deterministic)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap; sorted is a valid heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KvLayoutError(f"pool full: {n} slots asked, {len(self._free)} free of {self.num_slots}")
        slots = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(slots)
        return slots

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if s not in self._used:
                raise KvLayoutError(f"slot {s} freed but not allocated")
            self._used.remove(s)
            heapq.heappush(self._free, s)
