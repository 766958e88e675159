"""Vectorised evaluation of every candidate split over a window's slices (METHOD.md eq. 5/6).

Pure: numpy only. Nodes are given in *assignment order* ``seq``: candidate ``P`` makes
``seq[:P]`` the prefill nodes and ``seq[P:]`` the decode nodes (the planner builds ``seq`` so
that this equals "switch the least-loss nodes"). All candidates are evaluated in
O(N^2 * S) arithmetic with no Python loop over nodes: prefix sums for the prefill side, and per
decode count ``D`` one vector over the last ``D`` nodes.

Units: service rates in requests/s, times in seconds, tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.costmodel import DecodeModel, PrefillModel
from services.planner.window import Work


@dataclass(frozen=True)
class NodeArrays:
    """Per-node model coefficients and capacities in assignment order."""

    coef_p: np.ndarray  # (N, 4) c0..c3
    fill: np.ndarray  # (N,) new tokens per prefill iteration (measured fill, at most the budget)
    coef_d: np.ndarray  # (N, 3) d0..d2
    cap: np.ndarray  # (N,) max running requests in decode
    kv_tokens: np.ndarray  # (N,) GPU KV capacity in tokens (0: unknown, no KV limit)
    k: int
    E: int


@dataclass(frozen=True)
class WorkArrays:
    t_uc: np.ndarray
    A: np.ndarray
    t_rst: np.ndarray
    t_out: np.ndarray
    t_acc: np.ndarray
    t_fwd: np.ndarray
    q: np.ndarray
    arrivals_rps: np.ndarray
    context: np.ndarray

    @classmethod
    def of(cls, works: list[Work]) -> WorkArrays:
        def col(name: str) -> np.ndarray:
            return np.array([getattr(w, name) for w in works], dtype=float)

        return cls(
            col("t_uc"),
            col("A"),
            col("t_rst"),
            col("t_out"),
            col("t_acc"),
            col("t_fwd"),
            col("q"),
            col("arrivals_rps"),
            col("context"),
        )


def prefill_rates(nodes: NodeArrays, w: WorkArrays) -> np.ndarray:
    """mu_P[n, s] = 1 / (c0 * max(1, t_uc) / fill + c1 t_uc + c2 A + c3 t_rst): requests/s of a
    busy prefill node whose iterations carry ``fill`` new tokens and so share ``c0``."""
    c = nodes.coef_p
    cost = (
        c[:, :1] * np.maximum(1.0, w.t_uc)[None, :] / nodes.fill[:, None]
        + c[:, 1:2] * w.t_uc[None, :]
        + c[:, 2:3] * w.A[None, :]
        + c[:, 3:4] * w.t_rst[None, :]
    )
    return 1.0 / np.maximum(cost, 1e-12)


def batch_cap(cap: float, kv_tokens: float, context: np.ndarray) -> np.ndarray:
    """Most requests a decode node can run per slice: ``max_running_requests`` and, when its GPU
    KV capacity is known, ``kv_tokens / context`` (agents' long contexts fill KV first)."""
    if kv_tokens <= 0:
        return np.full(context.shape, float(cap))
    return np.minimum(float(cap), np.maximum(1.0, np.floor(kv_tokens / np.maximum(1.0, context))))


def decode_rates(nodes: NodeArrays, w: WorkArrays, D: int, sel: slice) -> np.ndarray:
    """mu_D[n, s] for nodes ``sel`` when ``D`` decode nodes share the decode population ``q``:
    batch B = min(batch_cap, q / D); mu = B / (ceil(t_out / t_acc) * T_iter(B))."""
    c = nodes.coef_d[sel]
    # B and phi depend on a node only through (cap, kv_tokens): compute them once per distinct pair
    pairs = np.stack([nodes.cap[sel], nodes.kv_tokens[sel]], axis=1)
    uniq, inverse = np.unique(pairs, axis=0, return_inverse=True)
    caps_u = np.stack([batch_cap(cap, kv, w.context) for cap, kv in uniq])
    B_u = np.minimum(caps_u, (w.q / D)[None, :])
    phi_u = 1.0 - (1.0 - nodes.k / nodes.E) ** (w.t_fwd[None, :] * B_u)
    inverse = inverse.reshape(-1)
    B, phi = B_u[inverse], phi_u[inverse]
    T = c[:, :1] + c[:, 1:2] * phi + c[:, 2:3] * B
    iters = np.ceil(w.t_out / w.t_acc)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = np.where(B > 0, B / (iters[None, :] * T), 0.0)
    return mu


def theta(nodes: NodeArrays, w: WorkArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Theta[P-1, s] for P = 1..N-1 (eq. 5), with sum mu_P and sum mu_D."""
    N = nodes.coef_p.shape[0]
    muP = prefill_rates(nodes, w)
    sumP = np.cumsum(muP, axis=0)[: N - 1]  # row P-1: nodes seq[:P]
    sumD = np.empty_like(sumP)
    for P in range(1, N):
        sumD[P - 1] = decode_rates(nodes, w, N - P, slice(P, N)).sum(axis=0)
    return np.minimum(sumP, sumD), sumP, sumD


def erlang_c_wait_p95(lam: float, mu: np.ndarray, servers: np.ndarray, horizon_s: float) -> np.ndarray:
    """P95 queue wait (s) of an M/M/c queue per candidate (``servers`` c, per-server rate
    ``mu``), from P(W > t) = C(c, a) * exp(-(c mu - lam) t). Overload (lam >= c mu): the backlog
    a sustained overload builds over ``horizon_s``: (lam - c mu) * horizon_s / (c mu)."""
    mu = np.asarray(mu, dtype=float)
    c = np.asarray(servers, dtype=int)
    out = np.zeros(len(c))
    if lam <= 0:
        return out
    cap = c * mu
    over = lam >= cap
    out[over] = (lam - cap[over]) * horizon_s / np.maximum(cap[over], 1e-12)
    ok = ~over
    if ok.any():
        a = lam / mu[ok]
        cc = c[ok]
        B = np.ones_like(a)
        for i in range(1, int(cc.max()) + 1):  # Erlang B recursion, frozen once i > c
            step = i <= cc
            B = np.where(step, a * B / (i + a * B), B)
        rho = a / cc
        C = B / (1.0 - rho * (1.0 - B))
        rate = cap[ok] - lam
        out[ok] = np.where(C > 0.05, np.log(np.maximum(C, 1e-300) / 0.05) / rate, 0.0)
    return out


def prefill_latency_s(
    coef_p: np.ndarray, fill: np.ndarray, t_uc: float, A: float, t_rst: float
) -> np.ndarray:
    """Prefill time of one request per node: ceil(t_uc / fill) iterations (chunked
    prefill; total A does not depend on the chunking)."""
    chunks = np.maximum(1.0, np.ceil(t_uc / fill))
    return chunks * coef_p[:, 0] + coef_p[:, 1] * t_uc + coef_p[:, 2] * A + coef_p[:, 3] * t_rst


def theta_reference(nodes: NodeArrays, works: list[Work]) -> list[list[float]]:
    """Theta[P-1][s] recomputed from scratch per candidate with the scalar cost models: the
    naive evaluation the vectorised :func:`theta` must equal (tests) and beat (benchmark)."""
    N = nodes.coef_p.shape[0]
    pre = [PrefillModel(*map(float, c)) for c in nodes.coef_p]
    dec = [DecodeModel(*map(float, c), k=nodes.k, E=nodes.E) for c in nodes.coef_d]
    out: list[list[float]] = []
    for P in range(1, N):
        row = []
        for w in works:
            sum_p = 0.0
            for n in range(P):
                m = pre[n]
                cost = m.c0 * max(1.0, w.t_uc) / nodes.fill[n] + m.c1 * w.t_uc + m.c2 * w.A + m.c3 * w.t_rst
                sum_p += 1.0 / max(cost, 1e-12)
            sum_d = 0.0
            for n in range(P, N):
                cap = batch_cap(float(nodes.cap[n]), float(nodes.kv_tokens[n]), np.array([w.context]))[0]
                B = min(float(cap), w.q / (N - P))
                sum_d += dec[n].throughput_rps(w.t_out, w.t_acc, B, w.t_fwd) if B > 0 else 0.0
            row.append(min(sum_p, sum_d))
        out.append(row)
    return out
