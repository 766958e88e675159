"""Iteration-time cost models (METHOD.md §4.2, eq. 1 and eq. 2) and their NNLS fitting; the
router's fetch-time model, learned online from measured fetches (:class:`FetchCostLearner`).

Pure: no I/O, no clock, no randomness; imports only the standard library, numpy and scipy.
All times are seconds, all sizes tokens (or query-key pairs for ``A``).

Prefill (eq. 1), one iteration of node n::

    T = c0 + c1 * sum(t_uc) + c2 * sum(A) + c3 * sum(t_rst),   A = t_uc*t_c + t_uc*(t_uc+1)/2

Decode (eq. 2), one iteration with B running requests each feeding ``t_fwd`` tokens::

    T = d0 + d1 * phi(B) + d2 * B + d3 * sum_ctx,   phi(B) = 1 - (1 - k/E) ** (t_fwd * B)

(``d3``, the context the batch attends over, is not in METHOD's eq. 2: measured iterations of
dense models ask for it; see :class:`DecodeModel`.)

Fitting is non-negative least squares on *relative* residuals (each row divided by its
measured duration, so a 5 % error on a 20 ms iteration weighs as much as on a 2 s one) with
columns scaled to unit norm (``sum_A`` is ~1e9 while the intercept is 1). Every fifth sample
(index 4, 9, ...) is held back to measure the mean absolute percentage error (MAPE); the
coefficients come from the other samples only. A column that never varies from zero in the
samples (say no restore from host ever happened) cannot be identified: its coefficient keeps
the prior's value and the fit says so in ``unidentified``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.cores.numerics import matvec, nnls, power, total

#: Default model profile: routed experts chosen per token (k) out of E (GLM-5.2-like MoE).
DEFAULT_K = 8
DEFAULT_E = 256
#: Fewest training samples (after hold-back) for a fit; fewer -> "not fitted yet".
MIN_TRAIN_SAMPLES = 8
#: Hold back one sample in this many for the MAPE.
HOLDOUT_EVERY = 5


def prefill_A(t_uc: float, t_c: float) -> float:
    """Query-key pairs of a causal prefill of ``t_uc`` new tokens after ``t_c`` cached ones."""
    return t_uc * t_c + t_uc * (t_uc + 1) / 2.0


def phi(batch: float, t_fwd: float, k: int, E: int) -> float:
    """Expected fraction of routed experts one decode iteration reads (eq. 2)."""
    if batch <= 0:
        return 0.0
    return 1.0 - (1.0 - k / E) ** (t_fwd * batch)


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Eq. 1 coefficients: ``c0`` s/iteration, ``c1`` s/new token, ``c2`` s/query-key pair,
    ``c3`` s/token restored from host memory."""

    c0: float
    c1: float
    c2: float
    c3: float

    @property
    def coefficients(self) -> list[float]:
        return [self.c0, self.c1, self.c2, self.c3]

    def iteration_s(self, sum_t_uc: float, sum_A: float, sum_t_rst: float = 0.0) -> float:
        return self.c0 + self.c1 * sum_t_uc + self.c2 * sum_A + self.c3 * sum_t_rst

    def request_s(self, t_uc: float, t_c: float, t_rst: float = 0.0, token_budget: int = 16384) -> float:
        """Prefill time of one request alone: chunked prefill, one chunk of at most
        ``token_budget`` new tokens per iteration; each chunk's ``A`` counts the cached tokens
        and the chunks before it. Restored tokens are charged to the first chunk (the restore
        precedes the computation). A fully cached request still takes one iteration."""
        budget = max(1, int(token_budget))
        remaining = max(0.0, float(t_uc))
        before = max(0.0, float(t_c))
        total = 0.0
        rst = max(0.0, float(t_rst))
        while True:
            chunk = min(remaining, float(budget))
            total += self.iteration_s(chunk, prefill_A(chunk, before), rst)
            rst = 0.0
            remaining -= chunk
            before += chunk
            if remaining <= 0.0:
                return total

    def request_cost_s(self, t_uc: float, t_c: float, t_rst: float = 0.0, token_budget: int = 16384) -> float:
        """Node time one request takes on a *saturated* prefill node: every iteration is
        filled to ``token_budget`` new tokens, so the fixed cost ``c0`` is shared in
        proportion to the request's new tokens (at least one token's share). ``1 /`` this
        is the node's service rate for that request (requests/s)."""
        budget = max(1, int(token_budget))
        share = max(1.0, float(t_uc)) / budget
        return self.c0 * share + self.c1 * t_uc + self.c2 * prefill_A(t_uc, t_c) + self.c3 * t_rst


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """Eq. 2 coefficients: ``d0`` s/iteration, ``d1`` s for reading every routed expert once,
    ``d2`` s per running request; ``k`` of ``E`` routed experts per token (model profile);
    ``d3`` s per context token the batch attends over (``sum_ctx``): a dense model, or any
    model whose KV reads grow with the context, pays it every step (eq. 2 has no such term;
    measured, a dense 7B model's decode is 32 % off without it and 3.3 % with it). A fit on
    iterations that report no context (``sum_t_c`` 0) cannot identify it and keeps the prior's 0."""

    d0: float
    d1: float
    d2: float
    k: int = DEFAULT_K
    E: int = DEFAULT_E
    d3: float = 0.0

    @classmethod
    def of(cls, coefficients: Sequence[float], k: int = DEFAULT_K, E: int = DEFAULT_E) -> DecodeModel:
        """From a ``ModelFitted``'s coefficients: ``[d0, d1, d2, d3]``, or ``[d0, d1, d2]`` as
        logs and snapshots written before the context term carry them."""
        c = [float(x) for x in coefficients]
        return cls(c[0], c[1], c[2], k=k, E=E, d3=c[3] if len(c) > 3 else 0.0)

    @property
    def coefficients(self) -> list[float]:
        return [self.d0, self.d1, self.d2, self.d3]

    def iteration_s(self, batch: float, t_fwd: float = 1.0, sum_ctx: float = 0.0) -> float:
        return self.d0 + self.d1 * phi(batch, t_fwd, self.k, self.E) + self.d2 * batch + self.d3 * sum_ctx

    def request_s(self, t_out: float, t_acc: float, batch: float, t_fwd: float = 1.0, context: float = 0.0) -> float:
        """Decode time of one request: ``ceil(t_out / t_acc)`` iterations at ``batch``, each of
        the batch's requests attending over ``context`` tokens."""
        iters = math.ceil(max(0.0, float(t_out)) / max(1e-9, float(t_acc)))
        return iters * self.iteration_s(batch, t_fwd, batch * context)

    def throughput_rps(self, t_out: float, t_acc: float, batch: float, t_fwd: float = 1.0,
                       context: float = 0.0) -> float:
        """Requests/s a decode node completes with ``batch`` requests always running."""
        if batch <= 0:
            return 0.0
        per = self.request_s(max(1.0, t_out), t_acc, batch, t_fwd, context)
        return batch / per if per > 0 else 0.0


#: Documented defaults until a ModelFitted arrives (GB300 x4, TP4, GLM-5.2-like MoE, FP8 KV):
#: 16K new tokens ~ 0.5 s; 100K cached context adds ~0.16 s per 16K chunk; restore from host
#: over NVLink-C2C ~2 us/token. Decode 17-45 ms per iteration at 8-64 requests (METHOD §4.2).
PRIOR_PREFILL = PrefillModel(c0=0.010, c1=3.0e-5, c2=1.0e-10, c3=2.0e-6)
PRIOR_DECODE = DecodeModel(d0=0.012, d1=0.015, d2=3.0e-4, k=DEFAULT_K, E=DEFAULT_E)


@dataclass(frozen=True, slots=True)
class Fit:
    """Outcome of one fit. ``coefficients`` is empty when not fitted (``status`` says why)."""

    status: str
    coefficients: list[float] = field(default_factory=list)
    samples: int = 0
    mape: float = 0.0
    unidentified: list[int] = field(default_factory=list)

    @property
    def fitted(self) -> bool:
        return bool(self.coefficients)


def min_samples(min_train: int = MIN_TRAIN_SAMPLES) -> int:
    """Fewest usable samples that leave ``min_train`` for training and one held back."""
    n = min_train + 1
    while n - n // HOLDOUT_EVERY < min_train or n // HOLDOUT_EVERY < 1:
        n += 1
    return n


def _split(n: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.arange(n)
    hold = (idx % HOLDOUT_EVERY) == HOLDOUT_EVERY - 1
    return ~hold, hold


def _nnls_relative(X: np.ndarray, y: np.ndarray, prior: Sequence[float]) -> tuple[np.ndarray, list[int]]:
    """min ||(X c - y) / y|| subject to c >= 0; unit-norm columns; all-zero columns keep prior."""
    w = 1.0 / y
    Xw = X * w[:, None]
    # every reduction exactly rounded (services.cores.numerics): the same fit on every machine
    norms = np.sqrt(np.array([total(Xw[:, j] * Xw[:, j]) for j in range(Xw.shape[1])]))
    live = norms > 0
    coef = np.array(prior, dtype=float)
    unidentified = [int(i) for i in np.flatnonzero(~live)]
    if live.any():
        # dead columns are all zero in these samples, so they contribute nothing to the fit
        sol = nnls(Xw[:, live] / norms[live], np.ones_like(y), maxiter=50 * X.shape[1])
        coef[live] = sol / norms[live]
    return np.maximum(coef, 0.0), unidentified


def usable(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The rows a fit uses: a duration under a nanosecond or a count beyond 1e15 is a broken
    report, not a sample."""
    return np.isfinite(y) & (y > 1e-9) & np.all(np.isfinite(X) & (np.abs(X) < 1e15), axis=1)


def fit_coefficients(X: np.ndarray, y: np.ndarray) -> tuple[list[float], list[int]]:
    """The NNLS fit (relative residuals, unit-norm columns) on *all* the given rows, no hold-back
    (for cross-validation by the caller); an all-zero column gets 0 and is listed."""
    X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    coef, unidentified = _nnls_relative(X, y, [0.0] * X.shape[1])
    return [float(c) for c in coef], unidentified


def _fit(X: np.ndarray, y: np.ndarray, prior: Sequence[float], min_train: int) -> Fit:
    good = usable(X, y)
    X, y = X[good], y[good]
    n = len(y)
    train, hold = _split(n)
    n_train = int(train.sum())
    if n_train < min_train or not hold.any():
        return Fit(status=f"not fitted yet: {n} usable samples, need {min_samples(min_train)}", samples=n)
    coef, unidentified = _nnls_relative(X[train], y[train], prior)
    pred = matvec(X[hold], coef)
    mape = total(np.abs(pred - y[hold]) / y[hold]) / int(hold.sum())
    return Fit(
        status="fitted",
        coefficients=[float(c) for c in coef],
        samples=n,
        mape=mape,
        unidentified=unidentified,
    )


def cross_validated_ape(X: np.ndarray, y: np.ndarray, folds: int = 5) -> np.ndarray:
    """Absolute percentage error of every row, each predicted by ``fit_coefficients`` on the other
    folds (row i in fold i mod ``folds``): how a form of the model does on rows it was not fitted on.
    The check of the fitter on public GPU timings (``bench planner --timings``) and of a live run's
    calibration (``evolving calibrate``) both score forms with it."""
    fold = np.arange(len(y)) % folds
    ape = np.empty(len(y))
    for f in range(folds):
        test = fold == f
        coef, _ = fit_coefficients(X[~test], y[~test])
        ape[test] = np.abs(X[test] @ np.asarray(coef) - y[test]) / y[test]
    return ape


def fit_columns(X: np.ndarray, y: np.ndarray, min_train: int = MIN_TRAIN_SAMPLES) -> Fit:
    """The same NNLS fit (relative residuals, unit-norm columns, every fifth sample held back)
    over any design ``X`` (rows: iterations, columns: terms) and measured durations ``y``;
    an all-zero column gets coefficient 0. For comparing model forms on measured iterations."""
    X = np.asarray(X, dtype=float)
    return _fit(X, np.asarray(y, dtype=float), [0.0] * X.shape[1], min_train)


def prefill_design(samples: Iterable[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``(sum_t_uc, sum_A, sum_t_rst, duration_s)`` -> (X, y) for eq. 1."""
    arr = np.asarray(list(samples), dtype=float).reshape(-1, 4)
    X = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1], arr[:, 2]])
    return X, arr[:, 3]


def decode_design(samples: Iterable[Sequence[float]], k: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``(batch, t_fwd, sum_ctx, duration_s)`` (or ``(batch, t_fwd, duration_s)``, no
    context) -> (X, y) for eq. 2 with the context term: columns ``1, phi(B), B, sum_ctx``."""
    rows = [list(r) for r in samples]
    if rows and len(rows[0]) == 3:
        rows = [[r[0], r[1], 0.0, r[2]] for r in rows]
    arr = np.asarray(rows, dtype=float).reshape(-1, 4)
    B, t_fwd = arr[:, 0], arr[:, 1]
    ph = np.where(B > 0, 1.0 - power(1.0 - k / E, t_fwd * B), 0.0)
    X = np.column_stack([np.ones(len(arr)), ph, B, arr[:, 2]])
    return X, arr[:, 3]


def fit_prefill(
    samples: Iterable[Sequence[float]],
    prior: PrefillModel = PRIOR_PREFILL,
    min_train: int = MIN_TRAIN_SAMPLES,
) -> Fit:
    """NNLS fit of eq. 1 from rows ``(sum_t_uc, sum_A, sum_t_rst, duration_s)``."""
    X, y = prefill_design(samples)
    return _fit(X, y, prior.coefficients, min_train)


def fit_decode(
    samples: Iterable[Sequence[float]],
    k: int = DEFAULT_K,
    E: int = DEFAULT_E,
    prior: DecodeModel = PRIOR_DECODE,
    min_train: int = MIN_TRAIN_SAMPLES,
) -> Fit:
    """NNLS fit of eq. 2 and its context term from rows ``(batch, t_fwd, sum_ctx, duration_s)``."""
    X, y = decode_design(samples, k, E)
    return _fit(X, y, prior.coefficients, min_train)


# --------------------------------------------------------------------------- fetch cost (router)
@dataclass(frozen=True, slots=True)
class FetchModel:
    """Time of one asynchronous fetch from a peer's host memory (METHOD.md §4.1): peer L2 ->
    own L2 -> GPU, ``latency_s + s_per_token * tokens`` (seconds)."""

    latency_s: float
    s_per_token: float

    def fetch_s(self, tokens: float) -> float:
        return self.latency_s + self.s_per_token * tokens if tokens > 0 else 0.0


#: The router's assumption until it has measured fetches: 2 ms setup, 16K tokens in ~8.5 ms.
PRIOR_FETCH = FetchModel(latency_s=0.002, s_per_token=4.0e-7)
#: Fewest measured fetches before the learned model replaces the prior.
FETCH_MIN_SAMPLES = 8
#: Measured fetches kept (the most recent; older ones are overwritten in a ring).
FETCH_MAX_SAMPLES = 256
#: Refit after this many new fetches (and at the first ``FETCH_MIN_SAMPLES``).
FETCH_REFIT_EVERY = 8


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """Median of pairwise slopes and median intercept (robust to ~29 % outliers); ``None`` if
    ``x`` has fewer than two distinct values."""
    dx = x[None, :] - x[:, None]
    dy = y[None, :] - y[:, None]
    upper = np.triu(np.ones(dx.shape, dtype=bool), k=1) & (dx != 0)
    if not upper.any():
        return None
    slope = float(np.median(dy[upper] / dx[upper]))
    return slope, float(np.median(y - slope * x))


class FetchCostLearner:
    """Online fit of :class:`FetchModel` from measured fetches (``KvFetched``), like the
    iteration-time models: the prior until ``min_samples`` fetches were measured, then a robust
    fit refitted every ``refit_every`` new ones. Pure and deterministic; ``to_state`` /
    ``from_state`` round-trip it.

    **From events to samples** (:meth:`observe`). A ``KvFetched`` names one source of one
    request's fetch and carries the fetch's whole ``duration_s`` (queued on the destination's
    link + transfer): the events of one ``(dst, request, ts)`` are one fetch, their blocks
    summed. A node's fetches share its link, first in first out, so a fetch that was queued
    behind the previous one into the same node began its transfer when that one landed: its
    transfer time is ``ts - max(ts - duration_s, previous landing on dst)`` (the classic
    departure-interval estimate of a FIFO server's service time). A fetch becomes a sample once
    a later event (:meth:`advance`) or the next fetch into the same node closes it. A fetch
    reported at the same time as the previous one into that node is taken as not queued (fetch
    at prefill start reports several at once, each with its own duration).

    **Fit.** Theil-Sen (median of pairwise slopes, median intercept) over the last
    ``max_samples`` samples: a fetch slowed by something the link model does not see (a
    fetch never reported, contention) moves neither median while such fetches are a minority.
    Both coefficients are clamped at 0. With a single fetch size seen, the latency stays the
    prior's and the slope is the median of ``(seconds - latency) / tokens``.
    """

    def __init__(self, prior: FetchModel = PRIOR_FETCH, min_samples: int = FETCH_MIN_SAMPLES,
                 max_samples: int = FETCH_MAX_SAMPLES, refit_every: int = FETCH_REFIT_EVERY) -> None:
        if not (math.isfinite(prior.latency_s) and math.isfinite(prior.s_per_token)):
            raise ValueError(f"fetch prior must be finite, got {prior}")
        if min_samples < 2 or max_samples < min_samples or refit_every < 1:
            raise ValueError(f"fetch learner: need 2 <= min_samples ({min_samples}) <= max_samples "
                             f"({max_samples}) and refit_every ({refit_every}) >= 1")
        self.prior = prior
        self.min_samples, self.max_samples, self.refit_every = min_samples, max_samples, refit_every
        self.samples: list[tuple[float, float]] = []  # (tokens, transfer seconds), a ring
        self.next_slot = 0
        self.seen = 0  # samples accepted since the start
        self.rejected = 0
        self.since_fit = 0
        self.fitted: FetchModel | None = None
        self.pending: dict[str, list] = {}  # dst -> [request, ts, duration_s, tokens]
        self.landed: dict[str, float] = {}  # dst -> ts the last closed fetch into it landed

    @property
    def model(self) -> FetchModel:
        """The learned model, or the prior until ``min_samples`` fetches were measured."""
        return self.fitted if self.fitted is not None else self.prior

    # ------------------------------------------------------------------ events -> samples
    def observe(self, dst: str, request: str, ts: float, duration_s: float, tokens: int) -> None:
        """One ``KvFetched`` into ``dst`` (``tokens`` = its blocks x block size)."""
        if self.pending:
            self.advance(ts)
        p = self.pending.get(dst)
        if p is not None and p[0] == request and p[1] == ts:
            p[3] += tokens  # another source of the same fetch
            return
        if p is not None:
            self._close(dst, p)
        self.pending[dst] = [request, ts, duration_s, tokens]

    def advance(self, ts: float) -> None:
        """Close every fetch that landed before ``ts`` (its events are all in)."""
        for dst in [d for d, p in self.pending.items() if p[1] < ts]:
            self._close(dst, self.pending[dst])

    def _close(self, dst: str, p: list) -> None:
        del self.pending[dst]
        _, ts, dur, tokens = p
        if not (math.isfinite(ts) and math.isfinite(dur)) or dur <= 0.0 or tokens <= 0:
            self.rejected += 1
            return
        began = ts - dur
        prev = self.landed.get(dst)
        if prev is not None and began < prev < ts:
            began = prev  # queued behind the previous fetch on this link
        self.landed[dst] = ts if prev is None else max(ts, prev)
        self.add(tokens, ts - began)

    # ------------------------------------------------------------------ samples -> model
    def add(self, tokens: float, seconds: float) -> bool:
        """One measured fetch; ``False`` (and counted in ``rejected``) if it is not one."""
        if not (math.isfinite(tokens) and math.isfinite(seconds)) or tokens <= 0 or seconds <= 0.0:
            self.rejected += 1
            return False
        row = (float(tokens), float(seconds))
        if len(self.samples) < self.max_samples:
            self.samples.append(row)
        else:
            self.samples[self.next_slot] = row
        self.next_slot = (self.next_slot + 1) % self.max_samples
        self.seen += 1
        self.since_fit += 1
        if len(self.samples) >= self.min_samples and (self.fitted is None or self.since_fit >= self.refit_every):
            self.refit()
        return True

    def refit(self) -> FetchModel | None:
        if len(self.samples) < self.min_samples:
            return None
        arr = np.asarray(self.samples, dtype=float)
        x, y = arr[:, 0], arr[:, 1]
        ts = theil_sen(x, y)
        if ts is None:
            lat = max(0.0, self.prior.latency_s)
            slope, intercept = float(np.median((y - lat) / x)), lat
        else:
            slope, intercept = ts
        self.fitted = FetchModel(latency_s=max(0.0, intercept), s_per_token=max(0.0, slope))
        self.since_fit = 0
        return self.fitted

    # ------------------------------------------------------------------ snapshot
    def to_state(self) -> dict:
        return {
            "prior": [self.prior.latency_s, self.prior.s_per_token],
            "limits": [self.min_samples, self.max_samples, self.refit_every],
            "samples": [list(r) for r in self.samples], "next_slot": self.next_slot,
            "seen": self.seen, "rejected": self.rejected, "since_fit": self.since_fit,
            "fitted": None if self.fitted is None else [self.fitted.latency_s, self.fitted.s_per_token],
            "pending": {d: list(p) for d, p in sorted(self.pending.items())},
            "landed": dict(sorted(self.landed.items())),
        }

    @classmethod
    def from_state(cls, st: dict) -> FetchCostLearner:
        f = cls(FetchModel(*st["prior"]), *st["limits"])
        f.samples = [(float(a), float(b)) for a, b in st["samples"]]
        f.next_slot, f.seen, f.rejected, f.since_fit = st["next_slot"], st["seen"], st["rejected"], st["since_fit"]
        f.fitted = None if st["fitted"] is None else FetchModel(*st["fitted"])
        f.pending = {d: list(p) for d, p in st["pending"].items()}
        f.landed = {d: float(v) for d, v in st["landed"].items()}
        return f
