"""One engine model on both sides of the side by side with the real Dynamo.

Dynamo's mocker (ai-dynamo 1.6.1, ``lib/mocker/src/common/perf_model.rs``) times a worker's
scheduler step from profiling data (``timing_model`` ``dynamo_profile``: an NPZ file):

- prefill: ``interp1d(prefill_isl -> prefill_ttft_ms)`` of the step's new tokens (linear,
  extrapolated), the prefix already cached not counted;
- decode: ``interp2d((decode_active_kv_tokens, decode_context_length) -> decode_itl)``
  (bilinear, extrapolated) of the batch's summed context and its mean context, at least 1 ms,
  one token per request per step.

Our sim engine (engine/backends/sim/node.py) charges eq. 1 per prefill iteration,
``c0 + c1 * new + c2 * A + c3 * restored`` (``A``: attention pairs, new tokens x context), and
eq. 2 per decode iteration, ``d0 + d1 * phi(B) + d2 * B + d_ctx * context``, accepting ``t_acc``
tokens per request.

What is exact: a prefill linear in its new tokens is what a piecewise-linear interpolation
reproduces digit for digit, so the equalised engine (:func:`equalised_profile`) is the profile
with ``c2 = 0`` (the mocker's 1-D prefill model cannot see the prefix a request attends to) and
``c3 = 0`` (the mocker's workers have no host tier here), noise off (the mocker has none).
Decode keeps all of eq. 2: ``B`` = summed context / mean context, the grid's value is eq. 2
divided by ``t_acc``, on a log-spaced grid dense enough that the bilinear interpolation stays
within 0.5% of eq. 2 (tests/unit/drivers/bench/test_dynamo_model.py). The equalised engine
decodes as the mocker steps: one token an iteration at eq. 2 / ``t_acc`` (``t_acc`` = 1 and
eq. 2's coefficients divided by the profile's ``t_acc``: the same time per token, and a request
joins or leaves the batch at a step's boundary, not at an MTP iteration's, 2.6 times longer on
``gb300-glm52-pressure``), and the mocker's decode worker emits every output token after the
KV transfer (its first included: one request's TTFT is prefill + transfer + one step), where our
node emits the first at the prefill's end and ``out - 1`` on the decode node, so our side is
given one more output token a request (:func:`mocker_decode_outputs`): our decode node then runs
the mocker's ``out`` steps. Capacities: ``num_gpu_blocks`` = L1 tokens /
block size per worker (one worker = one node), ``max_num_seqs`` = ``max_running``,
``max_num_batched_tokens`` = the prefill token budget, KV transfer P -> D at the profile's
bandwidth, with no fixed latency on either side (the mocker has none: 20K tokens at 150 GB/s
hand over in 5.99 ms). The model and its limits are in docs/experiments.md, "Against the real Dynamo".
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from engine.profiles import Profile
from replay.traces.format import Request

GRID_POINTS = 96
MAX_CONTEXT_TOKENS = 1 << 20  # the decode grid's context axis (the longest sessions are ~200K)


def equalised_profile(p: Profile) -> Profile:
    """The profile both sides run: what the mocker's model expresses exactly (module docstring):
    no attention or restore term, no noise, one token a decode iteration at eq. 2 / ``t_acc``, the
    P -> D transfer its bandwidth term only (the mocker's handoff: tokens x bytes / bandwidth)."""
    a = p.t_acc
    return replace(p, name=f"{p.name}+mocker", c2=0.0, c3=0.0, prefill_noise=0.0, decode_noise=0.0,
                   t_acc=1.0, d0=p.d0 / a, d1=p.d1 / a, d2=p.d2 / a, d_ctx=p.d_ctx / a, p2d_latency_s=0.0)


def mocker_decode_outputs(sessions: list) -> list:
    """``sessions`` with one more output token on every request that has one: the mocker's decode
    worker emits all ``output_length`` tokens after the transfer, our node emits the first at the
    prefill's end and the rest on the decode node (module docstring). A request with no output
    token is left as it is (Dynamo reports no TTFT for it)."""
    out = []
    for s in sessions:
        branches = []
        for b in s.branches:
            steps = [msgspec.structs.replace(st, output_tokens=st.output_tokens + 1)
                     if isinstance(st, Request) and st.output_tokens > 0 else st for st in b.steps]
            branches.append(msgspec.structs.replace(b, steps=steps))
        out.append(msgspec.structs.replace(s, branches=branches))
    return out


def decode_token_s(p: Profile, batch: float, context_tokens: float) -> float:
    """Seconds per output token of one request in a decode batch: eq. 2 / ``t_acc``."""
    return p.decode_iteration_s(batch, int(context_tokens)) / p.t_acc if batch > 0 else 0.0


def mocker_arrays(p: Profile) -> dict[str, np.ndarray]:
    """The mocker's ``dynamo_profile`` NPZ arrays for ``p`` (pass :func:`equalised_profile`)."""
    if p.c2 or p.c3:
        raise ValueError("the mocker's prefill model is 1-D in new tokens: equalise the profile first (c2 = c3 = 0)")
    isl = np.array([1.0, float(p.prefill_token_budget), 4.0 * p.prefill_token_budget])
    ttft_ms = 1000.0 * (p.c0 + p.c1 * isl)
    ctx = np.geomspace(p.block_tokens, MAX_CONTEXT_TOKENS, GRID_POINTS)
    active = np.geomspace(p.block_tokens, MAX_CONTEXT_TOKENS * p.max_running, GRID_POINTS)
    b = active[:, None] / ctx[None, :]  # the batch: summed context / mean context
    phi = 1.0 - (1.0 - p.experts_per_token / p.experts) ** (p.t_fwd * b)
    itl = 1000.0 * (p.d0 + p.d1 * phi + p.d2 * b + p.d_ctx * active[:, None]) / p.t_acc
    return {"prefill_isl": isl, "prefill_ttft_ms": ttft_ms, "decode_active_kv_tokens": active,
            "decode_context_length": ctx, "decode_itl": itl}


def write_mocker_npz(p: Profile, path: str | Path) -> Path:
    path = Path(path)
    np.savez(path, **mocker_arrays(p))
    return path


def bilinear(arrays: dict[str, np.ndarray], active_kv_tokens: float, context_tokens: float) -> float:
    """The mocker's decode interpolation (ndarray-interp ``Bilinear``, extrapolating), in ms."""
    x, y, z = arrays["decode_active_kv_tokens"], arrays["decode_context_length"], arrays["decode_itl"]
    i = int(np.clip(np.searchsorted(x, active_kv_tokens) - 1, 0, x.size - 2))
    j = int(np.clip(np.searchsorted(y, context_tokens) - 1, 0, y.size - 2))
    tx = (active_kv_tokens - x[i]) / (x[i + 1] - x[i])
    ty = (context_tokens - y[j]) / (y[j + 1] - y[j])
    return float((1 - tx) * (1 - ty) * z[i, j] + tx * (1 - ty) * z[i + 1, j]
                 + (1 - tx) * ty * z[i, j + 1] + tx * ty * z[i + 1, j + 1])


def mocker_engine_args(p: Profile, worker_type: str, npz: str | Path) -> dict[str, Any]:
    """``extra_engine_args`` / ``prefill_engine_args`` / ``decode_engine_args`` for one worker
    (one of our nodes) of ``p`` (pass :func:`equalised_profile`)."""
    if worker_type not in ("aggregated", "prefill", "decode"):
        raise ValueError(f"worker_type: aggregated, prefill or decode, got {worker_type!r}")
    return {"engine": {
        "block_size": p.block_tokens,
        "num_gpu_blocks": p.l1_capacity_tokens // p.block_tokens,
        "max_num_seqs": p.max_running,
        "max_num_batched_tokens": p.prefill_token_budget,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "worker_type": worker_type,
        "kv_transfer_bytes_per_token": p.kv_bytes_per_token,
        "kv_transfer_bandwidth": p.p2d_bandwidth_Bps / 1e9,  # GB/s
        "timing_model": {"type": "external", "provider": "dynamo_profile", "config": {"path": str(npz)}},
    }}


def ours_prefill_s(p: Profile, new_tokens: int) -> float:
    """One cold request's prefill on our engine: chunks of the token budget, eq. 1 each."""
    t, left, done = 0.0, new_tokens, 0
    while left > 0:
        n = min(left, p.prefill_token_budget)
        pairs = n * done + n * (n + 1) / 2  # each new token attends to the context before it and itself
        t += p.prefill_iteration_s(n, pairs, 0)
        left -= n
        done += n
    return t


def ours_decode_s(p: Profile, context_tokens: int, output_tokens: int) -> float:
    """One request decoding alone: ``ceil(out / t_acc)`` iterations of eq. 2 (batch 1)."""
    return math.ceil(output_tokens / p.t_acc) * p.decode_iteration_s(1, context_tokens)


__all__ = ["GRID_POINTS", "bilinear", "decode_token_s", "equalised_profile", "mocker_arrays", "mocker_decode_outputs",
           "mocker_engine_args", "ours_decode_s", "ours_prefill_s", "write_mocker_npz"]
