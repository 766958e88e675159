"""Vectorised evaluation of every candidate split over a window's slices (METHOD.md eq. 5/6).

Pure: numpy only. Nodes are given in *assignment order* ``seq``: candidate ``P`` makes
``seq[:P]`` the prefill nodes and ``seq[P:]`` the decode nodes (the planner builds ``seq`` so
that this equals "switch the least-loss nodes"). All candidates are evaluated in
O(N^2 * S) arithmetic with no Python loop over nodes: prefix sums for the prefill side, and per
decode count ``D`` one vector over the last ``D`` nodes.

Units: service rates in requests/s, times in seconds, tokens per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import gammaincc, gammaln, ndtr

import services.cores.numerics as nm
from services.cores.costmodel import DecodeModel, PrefillModel
from services.cores.planner.window import Work


@dataclass(frozen=True)
class NodeArrays:
    """Per-node model coefficients and capacities in assignment order."""

    coef_p: np.ndarray  # (N, 4) c0..c3
    fill: np.ndarray  # (N,) new tokens per prefill iteration (measured fill, at most the budget)
    coef_d: np.ndarray  # (N, 4) d0..d3
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
    t_c: np.ndarray | None = None
    # (S, 6) per-request means of t_uc^2, t_c^2, A^2, t_uc A, t_uc t_c, A t_c (see Work.moments)
    moments: np.ndarray | None = None
    cycle_s: np.ndarray | None = None
    prefill_queue: np.ndarray | None = None

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
            col("t_c"),
            np.array([_moments(w) for w in works], dtype=float).reshape(-1, 6),
            col("cycle_s"),
            col("prefill_queue"),
        )


def _moments(w: Work) -> tuple[float, ...]:
    """The work's second moments; without a known spread, those of the mean request."""
    if w.moments is not None:
        return w.moments
    return (w.t_uc**2, w.t_c**2, w.A**2, w.t_uc * w.A, w.t_uc * w.t_c, w.A * w.t_c)


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
    phi_u = 1.0 - nm.power(1.0 - nodes.k / nodes.E, w.t_fwd[None, :] * B_u)
    inverse = inverse.reshape(-1)
    B, phi = B_u[inverse], phi_u[inverse]
    T = c[:, :1] + c[:, 1:2] * phi + c[:, 2:3] * B
    if c.shape[1] > 3:  # d3: the context the batch attends over
        T = T + c[:, 3:4] * (B * w.context[None, :])
    iters = np.ceil(w.t_out / w.t_acc)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = np.where(B > 0, B / (iters[None, :] * T), 0.0)
    return mu


def theta(nodes: NodeArrays, w: WorkArrays, closed_loop: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Theta[P-1, s] for P = 1..N-1 (eq. 5), with sum mu_P and sum mu_D. ``closed_loop``: also
    at most what the agents of a closed loop bring at each split (``closed_loop_bound``)."""
    N = nodes.coef_p.shape[0]
    muP = prefill_rates(nodes, w)
    sumP = np.cumsum(muP, axis=0)[: N - 1]  # row P-1: nodes seq[:P]
    sumD = np.empty_like(sumP)
    for P in range(1, N):
        sumD[P - 1] = decode_rates(nodes, w, N - P, slice(P, N)).sum(axis=0)
    th = np.minimum(sumP, sumD)
    if closed_loop:
        th = np.minimum(th, closed_loop_bound(w, sumD))
    return th, sumP, sumD


#: the closed-loop bound leaves at least this share of the measured cycle outside decode
MIN_OUTSIDE_DECODE = 0.05


def closed_loop_bound(w: WorkArrays, sumD: np.ndarray) -> np.ndarray:
    """X[P-1, s]: the most requests per second the agents of a closed loop bring at each split.

    Per slice, ``n = lam * C`` agents are in the loop (Little's law over the measured branch
    cycle ``C``, ``cycle_s``, at the measured arrival rate ``lam``). Of a cycle, ``q / lam`` is
    spent in decode (Little's law over the measured decode population ``q``); at a split with
    decode rate ``sum mu_D`` that population takes ``R_D = q / sum mu_D`` instead. The rest of
    the cycle (think time, tools, the prefill wait and service: at least ``MIN_OUTSIDE_DECODE``
    of ``C``) is held at what was measured, so ``X = n / (C - q / lam + R_D)``. At the split
    served (``sum mu_D`` = the decode throughput) ``X`` is the arrival rate; a split that
    decodes faster shortens the cycle by what it saves a request and brings that much more,
    not the rate the same population would complete at. A slice without a measured cycle or
    arrivals (open arrivals, no branch seen twice) is not bounded (``inf``)."""
    lam, C = w.arrivals_rps, w.cycle_s
    if C is None:
        return np.full(sumD.shape, np.inf)
    ok = (lam > 0.0) & (C > 0.0) & (w.q > 0.0)
    lam_ok = np.where(ok, lam, 1.0)
    outside = np.maximum(C - w.q / lam_ok, MIN_OUTSIDE_DECODE * C)
    with np.errstate(divide="ignore", invalid="ignore"):
        r_d = np.where(sumD > 0.0, w.q[None, :] / sumD, np.inf)
        X = (lam * C)[None, :] / (outside[None, :] + r_d)
    return np.where(ok[None, :], X, np.inf)


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
        out[ok] = np.where(C > 0.05, nm.log(np.maximum(C, 1e-300) / 0.05) / rate, 0.0)
    return out


#: z of the 95th percentile of a standard normal (lognormal service-time tail)
Z95 = 1.6448536269514722


def prefill_cost_moments(coef_p: np.ndarray, fill: np.ndarray, w: WorkArrays) -> tuple[np.ndarray, np.ndarray]:
    """Mean and second moment of one request's node time on a busy prefill node, per node
    (rows of ``coef_p``/``fill``) and slice: cost = a t_uc + c2 A + r t_c with
    a = c0 / fill + c1 and r = c3 * (restored share of the cached tokens), over the slice's
    routed requests (``WorkArrays.moments``). The mean equals 1 / ``prefill_rates``."""
    t_c = w.t_c if w.t_c is not None else np.zeros_like(w.t_uc)
    share = np.divide(w.t_rst, t_c, out=np.zeros_like(t_c), where=t_c > 0)
    a = coef_p[:, :1] / fill[:, None] + coef_p[:, 1:2]
    b = np.broadcast_to(coef_p[:, 2:3], a.shape)
    r = coef_p[:, 3:4] * share[None, :]
    mean = (
        coef_p[:, :1] * np.maximum(1.0, w.t_uc)[None, :] / fill[:, None]
        + coef_p[:, 1:2] * w.t_uc[None, :]
        + coef_p[:, 2:3] * w.A[None, :]
        + coef_p[:, 3:4] * w.t_rst[None, :]
    )
    m = w.moments if w.moments is not None else np.array([_moments_of_means(w, s) for s in range(len(w.t_uc))])
    uc2, c2, A2, ucA, ucc, Ac = (m[:, i][None, :] for i in range(6))
    second = a * a * uc2 + b * b * A2 + r * r * c2 + 2 * a * b * ucA + 2 * a * r * ucc + 2 * b * r * Ac
    return mean, np.maximum(second, mean * mean)


def _moments_of_means(w: WorkArrays, s: int) -> tuple[float, ...]:
    t_c = 0.0 if w.t_c is None else float(w.t_c[s])
    uc, A = float(w.t_uc[s]), float(w.A[s])
    return (uc * uc, t_c * t_c, A * A, uc * A, uc * t_c, A * t_c)


def closed_wait(
    sources: float, think_s: float, mu: np.ndarray, servers: np.ndarray, q: float = 0.95
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, ``q`` quantile) of the queue wait per candidate at a station of ``servers``
    servers of rate ``mu`` fed by a closed population: ``sources`` agents, each spending an
    exponential ``think_s`` outside the station between requests (M/M/c//N, the
    machine-repairman model). Agents at fixed concurrency are such a loop: when prefill is
    short of capacity the queue holds the agents it keeps from thinking; it does not grow for
    ever. By the arrival theorem a request sees the stationary distribution of the other
    ``N - 1`` agents; with ``k >= c`` ahead of it, it waits for ``k - c + 1`` departures at
    rate ``c mu`` (Erlang: ``gammaincc``)."""
    mu = np.asarray(mu, dtype=float)
    c_all = np.asarray(servers, dtype=int)
    mean, tail = np.zeros(len(c_all)), np.zeros(len(c_all))
    M = round(float(sources)) - 1
    if M < 1 or think_s <= 0:
        return mean, tail
    k = np.arange(M + 1, dtype=float)
    base = gammaln(M + 1) - gammaln(M - k + 1)
    lgk = gammaln(k + 1)
    no_wait_at = math.inf  # capacity c*mu at which no request waited (more capacity: none either)
    for i, (m, c) in enumerate(zip(mu.tolist(), c_all.tolist(), strict=True)):
        if m <= 0:
            mean[i] = tail[i] = math.inf
            continue
        rate = c * m
        if rate >= no_wait_at and c >= 1:
            continue
        logp = base + k * math.log(1.0 / (think_s * m))
        logp -= np.where(k <= c, lgk, lgk[min(c, M)] + (k - c) * math.log(c))
        p = nm.exp(logp - logp.max())
        p /= nm.total(p)
        waits = (k >= c) & (p > 1e-12)
        pw, n = p[waits], k[waits] - c + 1
        mean[i] = nm.dot(pw, n) / rate
        if nm.total(pw) <= 1.0 - q:  # P95 wait 0, and 0 for every candidate with more capacity
            no_wait_at = min(no_wait_at, rate)
            continue
        lo, hi = 0.0, (n.max() + 10.0 * math.sqrt(n.max()) + 10.0) / rate
        for _ in range(40):
            t = 0.5 * (lo + hi)
            if _erlang_mixture_tail(pw, n, rate * t) > 1.0 - q:
                lo = t
            else:
                hi = t
        tail[i] = 0.5 * (lo + hi)
    return mean, tail


def _erlang_mixture_tail(p: np.ndarray, n: np.ndarray, x: float) -> float:
    """sum_i p_i P(Erlang(n_i, 1) > x): the exact tail (``gammaincc``) for n <= 50, its normal
    approximation beyond (sd sqrt(n) << n; ten times cheaper on a large cluster's queue)."""
    small = n <= 50
    out = nm.dot(p[small], gammaincc(n[small], x))
    big = ~small
    if big.any():
        nb = n[big]
        out += nm.dot(p[big], ndtr((nb - x) / np.sqrt(nb)))
    return out


def calibrate_rate(sources: float, think_s: float, mu: float, servers: int, measured_wait_s: float) -> float:
    """The factor ``f`` in [0.5, 2] for which the closed model's mean wait at ``servers``
    servers of rate ``f * mu`` equals the measured mean wait (bisection; the mean wait falls as
    ``f`` grows). Near saturation a few percent of error in the cost model's capacity is the
    difference between no queue and a long one; the queue measured at the split the nodes
    serve tells the true utilisation."""
    lo, hi = 0.5, 2.0
    for _ in range(30):
        f = 0.5 * (lo + hi)
        m, _ = closed_wait(sources, think_s, np.array([f * mu]), np.array([servers]))
        if m[0] > measured_wait_s:
            lo = f
        else:
            hi = f
    return 0.5 * (lo + hi)


def queue_prediction(
    nodes: NodeArrays, w: WorkArrays, horizon_s: float, serving_P: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(P95 prefill-queue wait, P95 TTFT) per candidate P = 1..N-1 (nodes ``seq[:P]`` prefill).

    Over the window, each slice weighs by its arrivals (a request's expected work is the
    request-weighted mean of the slices' mean work, not the mean of the slices' rates):

    - per node, mean service ``m_n`` = weighted mean of the slices' mean node time per request
      (``1 / prefill_rates``); the candidate's capacity ``c mu = sum_{n < P} 1 / m_n``;
    - squared coefficient of variation ``Cs^2`` of the service time from the routed requests'
      second moments of work (``prefill_cost_moments``, the candidate's mean coefficients);
    - wait: Erlang C (M/M/c) at ``lam`` = mean arrivals per second, its exponential tail's rate
      divided by ``(1 + Cs^2) / 2`` (Allen-Cunneen / Kingman for general service times):
      ``wait95 = ln(C / 0.05) * (1 + Cs^2) / 2 / (c mu - lam)``; overload (``lam >= c mu``):
      the backlog of ``horizon_s`` of it, ``(lam - c mu) * horizon_s / (c mu)``;
    - TTFT95 = wait95 + the P95 of the prefill latency, lognormal with the mean latency of the
      mean request (``prefill_latency_s``) and ``Cs^2``.
    """
    N = nodes.coef_p.shape[0]
    P_values = np.arange(1, N)
    S = len(w.t_uc)
    lam_s = np.maximum(w.arrivals_rps, 0.0)
    lam_sum = nm.total(lam_s)
    weights = lam_s / lam_sum if lam_sum > 0 else np.full(S, 1.0 / max(1, S))
    lam = lam_sum / S if S else 0.0
    cost_n = nm.matvec(1.0 / prefill_rates(nodes, w), weights)  # (N,) mean node time per request
    cap = np.cumsum(1.0 / np.maximum(cost_n, 1e-12))[: N - 1]  # c mu per candidate
    coef = np.cumsum(nodes.coef_p, axis=0)[: N - 1] / P_values[:, None]
    fill = np.cumsum(nodes.fill)[: N - 1] / P_values
    mean, second = prefill_cost_moments(coef, fill, w)
    m1, m2 = nm.matvec(mean, weights), nm.matvec(second, weights)
    cs2 = np.maximum(0.0, m2 / np.maximum(m1 * m1, 1e-300) - 1.0)
    lat = nm.matvec(np.stack(
        [prefill_latency_s(coef, fill, float(w.t_uc[s]), float(w.A[s]), float(w.t_rst[s])) for s in range(S)],
        axis=1,
    ), weights)
    cycle = nm.dot(w.cycle_s, weights) if w.cycle_s is not None else 0.0
    if cycle > 0 and lam > 0:  # a closed loop of agents (Little: N = lam * cycle)
        queued = float(w.prefill_queue.mean()) if w.prefill_queue is not None else 0.0
        all_coef = nodes.coef_p.mean(axis=0, keepdims=True)
        lat_now = float((prefill_latency_s(all_coef, np.array([nodes.fill.mean()]), nm.dot(w.t_uc, weights),
                                           nm.dot(w.A, weights), nm.dot(w.t_rst, weights)))[0])
        think = max(cycle - queued / lam - lat_now, 0.05 * cycle)
        spread = (1.0 + cs2) / 2.0  # Kingman's factor for the service-time spread
        if serving_P is not None and 1 <= serving_P <= N - 1 and queued > 0:  # the split served
            i = serving_P - 1
            cap = cap * calibrate_rate(lam * cycle, think, cap[i] / serving_P, serving_P, queued / lam)
            spread = np.ones_like(cs2)  # the measured queue already holds the spread
        wait95 = closed_wait(lam * cycle, think, cap / P_values, P_values)[1] * spread
    else:  # open arrivals: M/G/c (Erlang C, Allen-Cunneen)
        wait95 = erlang_c_wait_p95(lam, cap / P_values, P_values, horizon_s)
        wait95 = np.where(lam < cap, wait95 * (1.0 + cs2) / 2.0, wait95)
    # a request that shares its iterations with queued ones waits for their tokens too: with
    # probability ~ utilisation its last iteration is full (``fill`` new tokens, not its own)
    rho = np.minimum(1.0, lam / np.maximum(cap, 1e-12))
    lat = lat + rho * coef[:, 1] * np.maximum(0.0, fill - nm.dot(w.t_uc, weights))
    sigma2 = nm.log1p(cs2)
    lat95 = lat * nm.exp(Z95 * np.sqrt(sigma2) - sigma2 / 2.0)
    return wait95, wait95 + lat95


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
    dec = [DecodeModel.of(c.tolist(), k=nodes.k, E=nodes.E) for c in nodes.coef_d]
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
                sum_d += dec[n].throughput_rps(w.t_out, w.t_acc, B, w.t_fwd, w.context) if B > 0 else 0.0
            row.append(min(sum_p, sum_d))
        out.append(row)
    return out
