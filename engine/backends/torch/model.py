"""A Llama-architecture decoder over paged KV: RMSNorm, RoPE, grouped-query attention that reads
the sequence's KV blocks from a ``kernels.pool.BlockPool``, SwiGLU MLP. Small on purpose: the
reference the torch engine (engine/backends/torch/backend.py) computes with.

One ``forward`` serves prefill chunks, decode steps and mixes of both: each row of the batch
is one sequence with ``q_len`` new tokens at positions ``start .. start + q_len - 1``; their K
and V are written into the pool (``write``: slot and offset per new token), then every query
attends to the sequence's blocks (``read``: the slots of blocks ``0 .. n``) under a causal
mask. Rows are padded to the longest; padded queries see only real keys and are ignored.

The KV block layout is the data plane's (docs/kernels.md): ``[64 tokens, 2 * layers, kv_heads,
head_dim]`` per block, K of layer ``l`` at ``2l`` and V at ``2l + 1``. Q/K weights follow the
Hugging Face layout (rotate-half RoPE); GGUF files store them permuted for GGML's rope and are
un-permuted on load (engine/backends/torch/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.layout import KvLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_base: float = 10000.0
    eps: float = 1e-5
    max_pos: int = 8192
    bos: int = 1
    eos: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_layout(self, block_tokens: int = 64, dtype: str = "fp32") -> KvLayout:
        return KvLayout(block_tokens, 2 * self.layers, self.kv_heads, self.head_dim, dtype)


#: Weight names (Hugging Face's, per layer ``layers.{i}.``): what a loader must provide.
LAYER_WEIGHTS = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")


class Llama:
    """The weights on one device and the forward pass (module docstring)."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], device: str = "cpu",
                 dtype: str = "fp32") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.kv_dtype = dtype

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint has no weight {name!r}")
            return weights[name].to(self.device, self.dtype)

        self.embed = w("embed")
        self.norm = w("norm")
        self.lm_head = w("lm_head") if "lm_head" in weights else self.embed
        self.layers = []
        for i in range(cfg.layers):
            p = f"layers.{i}."
            self.layers.append({
                "attn_norm": w(p + "attn_norm"), "ffn_norm": w(p + "ffn_norm"),
                "qkv": torch.cat([w(p + "q"), w(p + "k"), w(p + "v")]).contiguous(),
                "o": w(p + "o"),
                "gate_up": torch.cat([w(p + "gate"), w(p + "up")]).contiguous(),
                "down": w(p + "down"),
            })
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(cfg.max_pos, dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos = ang.cos().to(self.device, self.dtype)
        self.sin = ang.sin().to(self.device, self.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(x.dtype) * w

    @staticmethod
    def _rot(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], dim=-1)

    @torch.inference_mode()
    def forward(self, kv: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, q_len: torch.Tensor,
                write: tuple[torch.Tensor, torch.Tensor], read: torch.Tensor, ctx: torch.Tensor,
                last: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` at query ``last[b]`` of each row.

        ``kv``: the pool's typed view ``[slots, T, 2L, Hkv, D]``; ``ids``/``pos``: ``[B, Q]``;
        ``q_len``: ``[B]`` real queries per row; ``write``: (slot, offset) ``[N]`` each, for the
        real queries in row-major order; ``read``: ``[B, nblk]`` slots of each row's blocks
        (padded with any valid slot); ``ctx``: ``[B]`` keys per row after this step."""
        cfg = self.cfg
        B, Q = ids.shape
        H, Hk, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        valid = torch.arange(Q, device=ids.device)[None, :] < q_len[:, None]  # [B, Q]
        T = read.shape[1] * kv.shape[1]
        keys = torch.arange(T, device=ids.device)
        mask = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < ctx[:, None, None])
        mask = mask[:, None]  # [B, 1, Q, T]
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # [B, Q, 1, D]
        wslot, woff = write
        flat = read.reshape(-1)
        h = self.embed[ids]
        for i, lw in enumerate(self.layers):
            x = self._rms(h, lw["attn_norm"])
            qkv = x @ lw["qkv"].T
            q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
            q = q.view(B, Q, H, D)
            k = k.view(B, Q, Hk, D)
            q = q * cos + self._rot(q) * sin
            k = k * cos + self._rot(k) * sin
            kc, vc = kv[:, :, 2 * i], kv[:, :, 2 * i + 1]  # [slots, T, Hk, D] views
            kc.index_put_((wslot, woff), k[valid].to(kc.dtype))
            vc.index_put_((wslot, woff), v.reshape(B, Q, Hk, D)[valid].to(vc.dtype))
            # index_select, not kc[read]: 2.5-6x faster on these strided slabs (measured, CPU)
            K = torch.index_select(kc, 0, flat).reshape(B, T, Hk, D).transpose(1, 2).to(q.dtype)
            V = torch.index_select(vc, 0, flat).reshape(B, T, Hk, D).transpose(1, 2).to(q.dtype)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, attn_mask=mask, enable_gqa=True)
            h = h + a.transpose(1, 2).reshape(B, Q, H * D) @ lw["o"].T
            x = self._rms(h, lw["ffn_norm"])
            g, u = (x @ lw["gate_up"].T).chunk(2, dim=-1)
            h = h + (F.silu(g) * u) @ lw["down"].T
        hl = h[torch.arange(B, device=ids.device), last]
        return (self._rms(hl, self.norm) @ self.lm_head.T).float()


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax per row, ties by the lowest id (``torch.argmax`` returns the first maximum)."""
    return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
