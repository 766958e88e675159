"""Paged KV layout: what one block holds and how many bytes it takes. Pure Python, no torch.

A block is ``block_tokens x layers x heads x head_dim`` elements of one KV dtype. K and V are
not a separate axis: a model with ``L`` layers stores ``layers=2*L`` (K then V per layer), MLA
models store their latent as ``heads=1``. Pools keep blocks as raw bytes so bf16, fp16 and the
fp8 formats move through the same kernels (fp8 has no arithmetic we need; we only copy it).
"""

from __future__ import annotations

from dataclasses import dataclass

#: KV dtype name -> bytes per element. Names follow SGLang's ``--kv-cache-dtype`` spelling.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}


class KvLayoutError(ValueError):
    """A layout, slot list or buffer does not fit the paged KV layout (the message says which)."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    block_tokens: int
    layers: int
    heads: int
    head_dim: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("block_tokens", "layers", "heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise KvLayoutError(f"KvLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise KvLayoutError(f"KvLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (self.block_tokens, self.layers, self.heads, self.head_dim)

    @property
    def block_elems(self) -> int:
        return self.block_tokens * self.layers * self.heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_elems * self.elem_bytes

    def fingerprint(self) -> str:
        """A short string two nodes compare before moving blocks between their pools."""
        return f"{self.dtype}:{self.block_tokens}x{self.layers}x{self.heads}x{self.head_dim}"

    @classmethod
    def from_fingerprint(cls, text: str) -> KvLayout:
        try:
            dtype, dims = text.split(":")
            bt, layers, heads, hd = (int(x) for x in dims.split("x"))
        except ValueError as exc:
            raise KvLayoutError(f"bad KV layout fingerprint {text!r} (want dtype:TxLxHxD)") from exc
        return cls(block_tokens=bt, layers=layers, heads=heads, head_dim=hd, dtype=dtype)


def coalesce_runs(src_slots: list[int], dst_slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(src_start, dst_start, count)`` where both slot lists advance by one.

    Pairs keep their order, so expanding the runs gives back ``zip(src_slots, dst_slots)``.
    One run becomes one memcpy / one DMA / one network transfer instead of ``count`` of them.
    """
    if len(src_slots) != len(dst_slots):
        raise KvLayoutError(
            f"slot lists differ in length: {len(src_slots)} source vs {len(dst_slots)} target"
        )
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_slots, dst_slots, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def check_slots(slots: list[int], num_slots: int, what: str, *, unique: bool) -> None:
    """Raise a one-line KvLayoutError when a slot is out of range (or repeated, for a write)."""
    for s in slots:
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < num_slots:
            raise KvLayoutError(f"{what}: slot {s!r} is outside 0..{num_slots - 1}")
    if unique and len(set(slots)) != len(slots):
        dup = next(s for s in slots if slots.count(s) > 1)
        raise KvLayoutError(f"{what}: slot {dup} is written twice in one call")
