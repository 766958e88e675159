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

Linear layers (``Linear``) run through oneDNN with their weights packed once on a CPU, through
``F.linear`` elsewhere; docs/engines.md, "Where a decode step's time goes".
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


def onednn_linear_available() -> bool:
    """Whether this torch can run linear layers through oneDNN with weights packed once
    (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``: x86 and Arm CPU builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """``x @ w.T (+ add)`` for a weight ``w [out, in]`` loaded once.

    ``packed``: on a CPU the weight is reordered once into oneDNN's blocked layout and every
    call runs oneDNN's fp32 GEMM (the residual add fused as a post-op) instead of ``F.linear``'s
    MKL sgemm: 2-4x faster at 8-32 rows, 1.4x at one, measured on this AMD EPYC (docs/engines.md,
    "Where a decode step's time goes"); fp32 throughout, and each row's result does not depend
    on how many rows are in the batch (``F.linear``'s does, in the last bits)."""

    __slots__ = ("packed", "w")

    def __init__(self, w: torch.Tensor, packed: bool) -> None:
        self.packed = packed
        # the batch-size hint only picks oneDNN's layout; results are the same for every hint
        self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8) if packed else w

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            if add is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.w, None, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, add, self.w, None, "add")
        y = F.linear(x, self.w)
        return y if add is None else add + y


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: Linear  # Q, K, V fused: [(heads + 2 kv_heads) x head_dim, hidden]
    o: Linear
    gate_up: Linear  # gate and up fused: [2 ffn, hidden]
    down: Linear


class Llama:
    """The weights on one device and the forward pass (module docstring).

    ``linear``: ``"onednn"`` (packed weights, CPU only), ``"aten"`` (``F.linear``) or ``"auto"``:
    oneDNN on a CPU whose torch has it, aten elsewhere (CUDA)."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], device: str = "cpu",
                 dtype: str = "fp32", linear: str = "auto") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.kv_dtype = dtype
        if linear not in ("auto", "onednn", "aten"):
            raise ValueError(f"linear must be auto, onednn or aten, got {linear!r}")
        on_cpu = self.device.type == "cpu"
        if linear == "onednn" and not (on_cpu and onednn_linear_available()):
            raise ValueError("linear='onednn' needs a CPU device and a torch built with oneDNN")
        packed = linear == "onednn" or (linear == "auto" and on_cpu and onednn_linear_available())
        self.linear = "onednn" if packed else "aten"

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint has no weight {name!r}")
            return weights[name].to(self.device, self.dtype)

        def lin(*names: str) -> Linear:
            return Linear(torch.cat([w(n) for n in names]).contiguous() if len(names) > 1 else w(names[0]), packed)

        self.embed = w("embed")
        self.norm = w("norm")
        self.lm_head = lin("lm_head" if "lm_head" in weights else "embed")
        self.layers: list[_Layer] = []
        for i in range(cfg.layers):
            p = f"layers.{i}."
            self.layers.append(_Layer(attn_norm=w(p + "attn_norm"), ffn_norm=w(p + "ffn_norm"),
                                      qkv=lin(p + "q", p + "k", p + "v"), o=lin(p + "o"),
                                      gate_up=lin(p + "gate", p + "up"), down=lin(p + "down")))
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(cfg.max_pos, dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos = ang.cos().to(self.device, self.dtype)
        # rotate-half RoPE: x * cos + cat(-x2, x1) * sin == x * cos + roll(x, d/2) * sin_signed
        # (the sign moved onto sin: the same products, bit for bit)
        sin = ang.sin()
        self.sin_signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2:]], dim=-1).to(self.device, self.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one op, the same result bit for bit as the lines below
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(x.dtype) * w

    @torch.inference_mode()
    def forward(self, kv: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, q_len: torch.Tensor,
                write: tuple[torch.Tensor, torch.Tensor], read: torch.Tensor, ctx: torch.Tensor,
                last: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, vocab]`` at query ``last[b]`` of each row.

        ``kv``: the pool's typed view ``[slots, T, 2L, Hkv, D]``; ``ids``/``pos``: ``[B, Q]``;
        ``q_len``: ``[B]`` real queries per row; ``write``: (slot, offset) ``[N]`` each, for the
        real queries in row-major order; ``read``: ``[B, nblk]`` slots of each row's blocks
        (padded with any valid slot); ``ctx``: ``[B]`` keys per row after this step.

        Per layer: one GEMM for Q/K/V, RoPE on Q and K at once (in place), one ``index_put_``
        writing the new tokens' K and V (adjacent in the block layout) into their slots, one
        ``index_select`` gathering the rows' blocks of K and V, SDPA, the output projection with
        the residual add fused, RMSNorm, one GEMM for gate/up, SiLU x up, down with the residual."""
        cfg = self.cfg
        B, Q = ids.shape
        N = B * Q
        H, Hk, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        dev = ids.device
        valid = torch.arange(Q, device=dev)[None, :] < q_len[:, None]  # [B, Q]
        real = None if Q == 1 or bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1)
        if real is not None:  # rows of unequal length: packed, no compute on padding
            return self._forward_packed(kv, ids, pos, q_len, write, read, ctx, last, real)
        T = read.shape[1] * kv.shape[1]
        keys = torch.arange(T, device=dev)
        mask = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < ctx[:, None, None])
        # the additive form SDPA turns a boolean mask into, made once rather than in every layer
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=dev).masked_fill_(~mask, float("-inf"))[:, None]
        flat_pos = pos.reshape(-1)
        cos, sin = self.cos[flat_pos][:, None], self.sin_signed[flat_pos][:, None]  # [N, 1, D]
        wslot, woff = write
        flat = read.reshape(-1)
        h = F.embedding(ids.reshape(-1), self.embed)  # [N, hidden]
        for i, lw in enumerate(self.layers):
            heads = lw.qkv(self._rms(h, lw.attn_norm)).view(N, H + 2 * Hk, D)
            qk = heads[:, : H + Hk]
            qk.copy_(qk * cos + qk.roll(D // 2, -1) * sin)
            new = heads[:, H:].view(N, 2, Hk, D)  # K, V of the new tokens: the block layout's order
            if real is not None:
                new = new.index_select(0, real)
            slab = kv[:, :, 2 * i: 2 * i + 2]  # [slots, T, 2, Hk, D]: layer i's K and V
            slab.index_put_((wslot, woff), new.to(slab.dtype))
            # index_select, not slab[read]: 2.5-6x faster on these strided slabs (measured, CPU)
            g = torch.index_select(slab, 0, flat).view(B, T, 2, Hk, D).to(self.dtype)
            q = heads[:, :H].view(B, Q, H, D).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, g[:, :, 0].transpose(1, 2), g[:, :, 1].transpose(1, 2),
                                               attn_mask=bias, enable_gqa=True)
            h = lw.o(a.transpose(1, 2).reshape(N, H * D), add=h)
            gate, up = lw.gate_up(self._rms(h, lw.ffn_norm)).chunk(2, dim=-1)
            h = lw.down(F.silu(gate) * up, add=h)
        hl = h if Q == 1 else h.view(B, Q, -1)[torch.arange(B, device=dev), last]
        return self.lm_head(self._rms(hl, self.norm)).float()

    def _forward_packed(self, kv: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, q_len: torch.Tensor,
                        write: tuple[torch.Tensor, torch.Tensor], read: torch.Tensor, ctx: torch.Tensor,
                        last: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for rows of unequal length (a prefill chunk beside decode tokens, or
        chunks of different sizes), the way a serving engine runs a mixed batch: the new tokens
        packed into one ``[N, hidden]`` matrix (N = the real tokens, not rows x the longest),
        each multi-token row attending over its own keys only, the one-token rows in one call.
        Padded, a 1,789-token chunk of 4 rows ran the linear layers on 3,268 rows and attention
        over 4 x 817 x 3,232 query-key pairs (its longest row's queries times its longest
        context) where 1.6 M are real: 7.0 s where a 2,048-token chunk alone took 4.6 s, a cost
        no per-token or per-pair model can learn (docs/simulator.md, section 9). The same
        products per real query as the padded pass."""
        cfg = self.cfg
        H, Hk, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        dev = ids.device
        bt = kv.shape[1]
        ql = q_len.tolist()
        ctx_l = ctx.tolist()
        flat_pos = pos.reshape(-1).index_select(0, real)
        N = flat_pos.shape[0]
        starts, off = [], 0
        for n in ql:
            starts.append(off)
            off += n
        # one-token rows: one batched call, keys padded to their longest context and masked
        ones = [b for b, n in enumerate(ql) if n == 1]
        groups = []  # (packed rows, read slots [G, nblk], bias [G, 1, q, T])
        if ones:
            nb = max(-(-ctx_l[b] // bt) for b in ones)
            sel = torch.tensor(ones, device=dev)
            rd = read.index_select(0, sel)[:, :nb]
            keys = torch.arange(nb * bt, device=dev)
            p1 = flat_pos.index_select(0, torch.tensor([starts[b] for b in ones], device=dev))
            m = (keys[None, :] <= p1[:, None]) & (keys[None, :] < ctx.index_select(0, sel)[:, None])
            bias = torch.zeros(m.shape, dtype=self.dtype, device=dev).masked_fill_(~m, float("-inf"))[:, None, None]
            groups.append((torch.tensor([starts[b] for b in ones], device=dev), rd, bias))
        for b, n in enumerate(ql):
            if n <= 1:
                continue
            nb = -(-ctx_l[b] // bt)
            keys = torch.arange(nb * bt, device=dev)
            pb = flat_pos[starts[b]: starts[b] + n]
            m = (keys[None, :] <= pb[:, None]) & (keys[None, :] < ctx_l[b])
            bias = torch.zeros(m.shape, dtype=self.dtype, device=dev).masked_fill_(~m, float("-inf"))[None, None]
            groups.append((slice(starts[b], starts[b] + n), read[b: b + 1, :nb], bias))
        cos, sin = self.cos[flat_pos][:, None], self.sin_signed[flat_pos][:, None]  # [N, 1, D]
        wslot, woff = write
        h = F.embedding(ids.reshape(-1).index_select(0, real), self.embed)  # [N, hidden]
        for i, lw in enumerate(self.layers):
            heads = lw.qkv(self._rms(h, lw.attn_norm)).view(N, H + 2 * Hk, D)
            qk = heads[:, : H + Hk]
            qk.copy_(qk * cos + qk.roll(D // 2, -1) * sin)
            slab = kv[:, :, 2 * i: 2 * i + 2]  # [slots, T, 2, Hk, D]: layer i's K and V
            slab.index_put_((wslot, woff), heads[:, H:].view(N, 2, Hk, D).to(slab.dtype))
            att = torch.empty(N, H, D, dtype=heads.dtype, device=dev)
            for rows, rd, bias in groups:
                G, nb = rd.shape
                g = torch.index_select(slab, 0, rd.reshape(-1)).view(G, nb * bt, 2, Hk, D).to(self.dtype)
                if isinstance(rows, slice):  # one row of many queries: [1, H, n, D]
                    q = heads[rows, :H].transpose(0, 1)[None]
                else:  # one query per row: [G, H, 1, D]
                    q = heads.index_select(0, rows)[:, :H, None]
                a = F.scaled_dot_product_attention(q, g[:, :, 0].transpose(1, 2), g[:, :, 1].transpose(1, 2),
                                                   attn_mask=bias, enable_gqa=True)
                if isinstance(rows, slice):
                    att[rows] = a[0].transpose(0, 1)
                else:
                    att.index_copy_(0, rows, a[:, :, 0])
            h = lw.o(att.reshape(N, H * D), add=h)
            gate, up = lw.gate_up(self._rms(h, lw.ffn_norm)).chunk(2, dim=-1)
            h = lw.down(F.silu(gate) * up, add=h)
        at = torch.tensor([starts[b] + int(x) for b, x in enumerate(last.tolist())], device=dev)
        return self.lm_head(self._rms(h.index_select(0, at), self.norm)).float()


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax per row, ties by the lowest id (``torch.argmax`` returns the first maximum)."""
    return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
