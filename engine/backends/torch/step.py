"""One iteration's batch as the model's input tensors (``model.Llama.forward``).

A row is ``(sequence, new token ids, start position)``: a prefill chunk or one decode token.
The index tensors are built from plain Python lists and made into tensors once each (eight
tensors per iteration, whatever the batch), not row by row; a decode step (one new token per
row) takes a shorter path. Rows are padded to the longest; the model masks the padding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from engine.backends.torch.model import Llama
from engine.backends.torch.state import Seq

Row = tuple[Seq, Sequence[int], int]


def inputs(rows: Sequence[Row], block_tokens: int, max_pos: int, device: torch.device) -> tuple:
    """``(ids, pos, q_len, (write slot, write offset), read, ctx, last)`` for ``Llama.forward``."""
    bt = block_tokens
    B = len(rows)
    Q = max(len(ids) for _, ids, _ in rows)
    ends = [start + len(ids) for _, ids, start in rows]
    nblk = math.ceil(max(ends) / bt)
    read = []
    for (s, _, _), end in zip(rows, ends, strict=True):
        k = math.ceil(end / bt)
        read.append(s.slots[:k] + [s.slots[0]] * (nblk - k))
    if Q == 1:  # a decode step: one token per row at position start
        ids_l = [ids[0] for _, ids, _ in rows]
        starts = [start for _, _, start in rows]
        ws = [s.slots[p // bt] for (s, _, _), p in zip(rows, starts, strict=True)]
        wo = [p % bt for p in starts]
        pos_l = [min(p, max_pos - 1) for p in starts]
        q_len, last = [1] * B, [0] * B
        ids_t = torch.tensor(ids_l, dtype=torch.long).view(B, 1)
        pos_t = torch.tensor(pos_l, dtype=torch.long).view(B, 1)
    else:
        ids_l, pos_l, ws, wo, q_len, last = [], [], [], [], [], []
        for s, ids, start in rows:
            n = len(ids)
            ids_l.extend(ids)
            ids_l.extend([0] * (Q - n))
            pos_l.extend(min(p, max_pos - 1) for p in range(start, start + Q))
            ws.extend(s.slots[p // bt] for p in range(start, start + n))
            wo.extend(p % bt for p in range(start, start + n))
            q_len.append(n)
            last.append(n - 1)
        ids_t = torch.tensor(ids_l, dtype=torch.long).view(B, Q)
        pos_t = torch.tensor(pos_l, dtype=torch.long).view(B, Q)

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    return (ids_t.to(device), pos_t.to(device), t(q_len), (t(ws), t(wo)), t(read), t(ends), t(last))


def forward(model: Llama, kv: torch.Tensor, rows: Sequence[Row], block_tokens: int = 64) -> tuple[torch.Tensor, float]:
    """One batched forward (run in a thread by the scheduler): logits ``[B, vocab]`` on the host
    and the wall seconds it took, the inputs' construction included."""
    t0 = time.perf_counter()
    logits = model.forward(kv, *inputs(rows, block_tokens, model.cfg.max_pos, model.device))
    out = logits.cpu()
    return out, time.perf_counter() - t0
