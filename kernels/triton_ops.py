"""A Triton row-copy kernel for CUDA pools: gather, scatter and pool-to-pool copy in one pass.

Used only with ``impl='triton'`` (``evolving bench kv`` on a GPU compares it with torch's
index kernels). Importing this module without triton is fine: ``HAVE_TRITON`` is then False.
Not exercised by CI (no GPU there); ``scripts/gpu_bench_kv.sh`` checks it against the reference.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only install
    HAVE_TRITON = False

#: Words (int64 when the block allows it) copied by one program instance.
BLOCK_WORDS = 1024

if HAVE_TRITON:

    @triton.jit
    def _copy_rows_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, row_words, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        s = tl.load(src_idx_ptr + row).to(tl.int64)
        d = tl.load(dst_idx_ptr + row).to(tl.int64)
        offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        vals = tl.load(src_ptr + s * row_words + offs, mask=mask)
        tl.store(dst_ptr + d * row_words + offs, vals, mask=mask)


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for 2-D same-dtype tensors on one CUDA device."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    assert src.dtype == dst.dtype and src.shape[1] == dst.shape[1], "row copy needs equal row types"
    n = src_idx.numel()
    if n == 0:
        return
    row_words = src.shape[1]
    grid = (n, triton.cdiv(row_words, BLOCK_WORDS))
    _copy_rows_kernel[grid](src, dst, src_idx, dst_idx, row_words, BLOCK=BLOCK_WORDS)
