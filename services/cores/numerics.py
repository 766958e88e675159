"""Machine-independent numerics for the cores: the same inputs give the same bits on every x86-64
(or other IEEE-754) machine, whatever BLAS kernel or SIMD width the process picked.

Why: a replay re-folds a recorded log and must reproduce every decision exactly, on any machine.
numpy's ``@`` on float64 calls BLAS (OpenBLAS picks a kernel per CPU, each summing in its own
order); numpy's float64 ``exp`` / ``log`` / ``log1p`` / ``power`` run SIMD loops chosen per CPU
(AVX-512 builds differ from AVX2 ones and from libm in the last bit); ``scipy.optimize.nnls``
runs LAPACK. A coefficient that differs in its 17th digit changes a ``ModelFitted`` event, and the
recorded log no longer verifies elsewhere.

What is used here instead:

* sums and dot products: :func:`math.fsum` over element-wise products (each product is one IEEE
  rounding, the same everywhere; ``fsum`` is exactly rounded), so order does not matter;
* transcendental functions: Python's :mod:`math` (the C library's scalar functions), one value at
  a time: one code path on every CPU that the C library runs on. (glibc picks its FMA variants on
  every x86-64 CPU since 2013 - Haswell, Zen; a CPU without FMA may round a rare value
  differently. That is the remaining dependence.)
* element-wise ``+ - * / sqrt`` stay numpy's: IEEE rounds them exactly, SIMD or not, and numpy
  never fuses two ufunc calls into one FMA;
* :func:`nnls`: Lawson-Hanson active set on the triangular factor of a Householder QR whose
  reductions are all ``fsum``; for the cores' designs (<= 6 columns, a few hundred rows) a
  fraction of a millisecond.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["dot", "exp", "log", "log1p", "matvec", "nnls", "power", "total"]


def total(a) -> float:
    """The exactly rounded sum of ``a``'s elements."""
    return math.fsum(np.asarray(a, dtype=float).ravel().tolist())


def dot(a, b) -> float:
    """``a @ b`` for two vectors, exactly rounded from the exact sum of the rounded products."""
    return math.fsum((np.asarray(a, dtype=float) * np.asarray(b, dtype=float)).ravel().tolist())


def matvec(M, v) -> np.ndarray:
    """``M @ v`` for a matrix ``(n, k)`` and a vector ``(k,)``, row by row as :func:`dot`."""
    prod = np.asarray(M, dtype=float) * np.asarray(v, dtype=float)[None, :]
    return np.array([math.fsum(row) for row in prod.tolist()], dtype=float).reshape(prod.shape[0])


def _elementwise(fn, a) -> np.ndarray | float:
    arr = np.asarray(a, dtype=float)
    if arr.ndim == 0:
        return fn(float(arr))
    return np.fromiter(map(fn, arr.ravel().tolist()), dtype=float, count=arr.size).reshape(arr.shape)


def exp(a):
    return _elementwise(math.exp, a)


def log(a):
    return _elementwise(math.log, a)


def log1p(a):
    return _elementwise(math.log1p, a)


def power(base: float, a):
    """``base ** a`` element-wise, for a scalar base and an array of exponents."""
    b = float(base)
    return _elementwise(lambda x: b ** x, a)


# ----------------------------------------------------------------------------------- NNLS
def _householder(M: list[list[float]], k: int) -> None:
    """In place: triangularise the first ``k`` columns of the row-major ``M`` (``n`` rows,
    ``m >= k`` columns) by Householder reflections applied to every column; rows ``0..k-1``
    then hold ``R`` (and ``Q^T`` times the extra columns)."""
    n, m = len(M), len(M[0]) if M else 0
    for j in range(min(k, n)):
        x = [M[i][j] for i in range(j, n)]
        norm = math.sqrt(math.fsum(t * t for t in x))
        if norm == 0.0:
            continue
        alpha = -norm if x[0] >= 0.0 else norm
        v = x
        v[0] = x[0] - alpha
        vv = math.fsum(t * t for t in v)
        if vv == 0.0:
            continue
        for c in range(j, m):
            s = 2.0 * math.fsum(v[i - j] * M[i][c] for i in range(j, n)) / vv
            if s != 0.0:
                for i in range(j, n):
                    M[i][c] = M[i][c] - s * v[i - j]
        M[j][j] = alpha
        for i in range(j + 1, n):
            M[i][j] = 0.0


def _lstsq(R: list[list[float]], d: list[float], cols: list[int]) -> list[float] | None:
    """min ||R[:, cols] z - d|| for the small square system (``R`` is k x k); None when the
    columns are (numerically) dependent."""
    k = len(d)
    M = [[R[i][c] for c in cols] + [d[i]] for i in range(k)]
    p = len(cols)
    _householder(M, p)
    scale = max((abs(M[i][i]) for i in range(p)), default=0.0)
    z = [0.0] * p
    for i in range(p - 1, -1, -1):
        if abs(M[i][i]) <= 1e-13 * scale or M[i][i] == 0.0:
            return None
        z[i] = (M[i][p] - math.fsum(M[i][j] * z[j] for j in range(i + 1, p))) / M[i][i]
    return z


def nnls(A, b, maxiter: int | None = None) -> np.ndarray:
    """min ||A x - b|| subject to x >= 0 (Lawson and Hanson's active-set method), with every
    reduction exactly rounded (module docstring): the same bits on every machine. ``A`` has few
    columns (the cores' cost models: <= 6); ties go to the lowest column index. A column that is a
    combination of the ones already in the solution stays at 0."""
    A = np.asarray(A, dtype=float)
    b = np.asarray(b, dtype=float).reshape(-1)
    n, k = A.shape
    if k == 0:
        return np.zeros(0)
    # ||A x - b|| = ||R x - d|| + const: solve on the k x k factor
    M = np.column_stack([A, b]).tolist()
    _householder(M, k)
    rows = min(n, k)
    R = [M[i][:k] for i in range(rows)] + [[0.0] * k for _ in range(k - rows)]
    d = [M[i][k] for i in range(rows)] + [0.0] * (k - rows)
    x = [0.0] * k
    passive: list[int] = []
    maxiter = 3 * k if maxiter is None else maxiter
    scale = max((abs(v) for row in R for v in row), default=0.0)
    tol = 10.0 * k * 2.220446049250313e-16 * max(scale, 1.0) * max(math.sqrt(math.fsum(t * t for t in d)), 1.0)
    banned: set[int] = set()
    for _ in range(maxiter):
        resid = [d[i] - math.fsum(R[i][j] * x[j] for j in range(k)) for i in range(k)]
        w = [math.fsum(R[i][j] * resid[i] for i in range(k)) for j in range(k)]
        candidates = [j for j in range(k) if j not in passive and j not in banned and w[j] > tol]
        if not candidates:
            break
        j_new = max(candidates, key=lambda j: (w[j], -j))
        passive.append(j_new)
        passive.sort()
        for _inner in range(3 * k + 1):
            z = _lstsq(R, d, passive)
            if z is None:  # the new column depends on the others: leave it out
                passive.remove(j_new)
                banned.add(j_new)
                break
            if all(v > 0.0 for v in z):
                for j, v in zip(passive, z, strict=True):
                    x[j] = v
                break
            # step from x towards z until the first passive coefficient reaches 0 (lowest index
            # on a tie); it leaves the passive set
            alpha, j_out = min((x[j] / (x[j] - v), j) for j, v in zip(passive, z, strict=True) if v <= 0.0)
            for j, v in zip(passive, z, strict=True):
                x[j] = x[j] + alpha * (v - x[j])
            x[j_out] = 0.0
            passive = [j for j in passive if x[j] > 0.0]
            for j in range(k):
                if j not in passive:
                    x[j] = 0.0
            if not passive:
                break
    return np.array([max(v, 0.0) for v in x], dtype=float)
