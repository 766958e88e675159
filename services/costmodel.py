"""Iteration-time cost models (METHOD.md §4.2, eq. 1 and eq. 2) and their NNLS fitting.

Pure: no I/O, no clock, no randomness; imports only the standard library, numpy and scipy.
All times are seconds, all sizes tokens (or query-key pairs for ``A``).

Prefill (eq. 1), one iteration of node n::

    T = c0 + c1 * sum(t_uc) + c2 * sum(A) + c3 * sum(t_rst),   A = t_uc*t_c + t_uc*(t_uc+1)/2

Decode (eq. 2), one iteration with B running requests each feeding ``t_fwd`` tokens::

    T = d0 + d1 * phi(B) + d2 * B,   phi(B) = 1 - (1 - k/E) ** (t_fwd * B)

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
from scipy.optimize import nnls

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
    ``d2`` s per running request; ``k`` of ``E`` routed experts per token (model profile)."""

    d0: float
    d1: float
    d2: float
    k: int = DEFAULT_K
    E: int = DEFAULT_E

    @property
    def coefficients(self) -> list[float]:
        return [self.d0, self.d1, self.d2]

    def iteration_s(self, batch: float, t_fwd: float = 1.0) -> float:
        return self.d0 + self.d1 * phi(batch, t_fwd, self.k, self.E) + self.d2 * batch

    def request_s(self, t_out: float, t_acc: float, batch: float, t_fwd: float = 1.0) -> float:
        """Decode time of one request: ``ceil(t_out / t_acc)`` iterations at ``batch``."""
        iters = math.ceil(max(0.0, float(t_out)) / max(1e-9, float(t_acc)))
        return iters * self.iteration_s(batch, t_fwd)

    def throughput_rps(self, t_out: float, t_acc: float, batch: float, t_fwd: float = 1.0) -> float:
        """Requests/s a decode node completes with ``batch`` requests always running."""
        if batch <= 0:
            return 0.0
        per = self.request_s(max(1.0, t_out), t_acc, batch, t_fwd)
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
    norms = np.linalg.norm(Xw, axis=0)
    live = norms > 0
    coef = np.array(prior, dtype=float)
    unidentified = [int(i) for i in np.flatnonzero(~live)]
    if live.any():
        # dead columns are all zero in these samples, so they contribute nothing to the fit
        sol, _ = nnls(Xw[:, live] / norms[live], np.ones_like(y), maxiter=50 * X.shape[1])
        coef[live] = sol / norms[live]
    return np.maximum(coef, 0.0), unidentified


def _fit(X: np.ndarray, y: np.ndarray, prior: Sequence[float], min_train: int) -> Fit:
    # a duration under a nanosecond or a count beyond 1e15 is a broken report, not a sample
    good = np.isfinite(y) & (y > 1e-9) & np.all(np.isfinite(X) & (np.abs(X) < 1e15), axis=1)
    X, y = X[good], y[good]
    n = len(y)
    train, hold = _split(n)
    n_train = int(train.sum())
    if n_train < min_train or not hold.any():
        return Fit(status=f"not fitted yet: {n} usable samples, need {min_samples(min_train)}", samples=n)
    coef, unidentified = _nnls_relative(X[train], y[train], prior)
    pred = X[hold] @ coef
    mape = float(np.mean(np.abs(pred - y[hold]) / y[hold]))
    return Fit(
        status="fitted",
        coefficients=[float(c) for c in coef],
        samples=n,
        mape=mape,
        unidentified=unidentified,
    )


def prefill_design(samples: Iterable[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``(sum_t_uc, sum_A, sum_t_rst, duration_s)`` -> (X, y) for eq. 1."""
    arr = np.asarray(list(samples), dtype=float).reshape(-1, 4)
    X = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1], arr[:, 2]])
    return X, arr[:, 3]


def decode_design(samples: Iterable[Sequence[float]], k: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``(batch, t_fwd, duration_s)`` -> (X, y) for eq. 2."""
    arr = np.asarray(list(samples), dtype=float).reshape(-1, 3)
    B, t_fwd = arr[:, 0], arr[:, 1]
    ph = np.where(B > 0, 1.0 - (1.0 - k / E) ** (t_fwd * B), 0.0)
    X = np.column_stack([np.ones(len(arr)), ph, B])
    return X, arr[:, 2]


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
    """NNLS fit of eq. 2 from rows ``(batch, t_fwd, duration_s)``."""
    X, y = decode_design(samples, k, E)
    return _fit(X, y, prior.coefficients, min_train)
