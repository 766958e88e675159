"""services.cores.numerics: the machine-independent NNLS and reductions the cost models use.
Agreement with scipy's LAPACK NNLS (the optimum, not the bits), the Karush-Kuhn-Tucker
conditions, exact rounding of sums, and the same answer for reordered rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls as scipy_nnls

from services.cores import numerics as nm
from tests.hyp import examples


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    k = draw(st.integers(1, 6))
    n = draw(st.integers(k, 200))
    A = rng.standard_normal((n, k))
    if draw(st.booleans()):
        A = np.abs(A) * rng.uniform(0.1, 1e3, size=k)  # positive, badly scaled (a cost model's design)
    b = np.ones(n) if draw(st.booleans()) else rng.standard_normal(n)
    return A, b


@settings(max_examples=examples(200), deadline=None, derandomize=True)
@given(problems())
def test_nnls_reaches_scipys_optimum_and_satisfies_kkt(prob):
    A, b = prob
    x = nm.nnls(A, b)
    ref, _ = scipy_nnls(A, b, maxiter=50 * A.shape[1])
    r, r_ref = np.linalg.norm(A @ x - b), np.linalg.norm(A @ ref - b)
    assert (x >= 0).all()
    assert r <= r_ref * (1 + 1e-9) + 1e-12
    # KKT: the gradient A^T (b - A x) is <= 0 where x = 0 and ~0 where x > 0
    g = A.T @ (b - A @ x)
    scale = np.linalg.norm(A, axis=0) * max(np.linalg.norm(b), 1.0)
    assert (g <= 1e-7 * scale).all()
    assert (np.abs(g[x > 0]) <= 1e-7 * scale[x > 0]).all()


def test_a_column_that_repeats_another_is_left_at_zero():
    rng = np.random.default_rng(1)
    a = np.abs(rng.standard_normal(50))
    A = np.column_stack([np.ones(50), a, a])
    x = nm.nnls(A, 1.0 + 2.0 * a)
    assert x[0] == pytest.approx(1.0) and x[1] + x[2] == pytest.approx(2.0)
    assert min(x[1], x[2]) == 0.0


def test_reductions_are_exactly_rounded_so_order_does_not_matter():
    vals = [1e16, 1.0, -1e16, 1.0] * 50
    assert nm.total(vals) == math.fsum(vals) == 100.0  # np.sum gives another answer
    a = np.array(vals)
    assert nm.dot(a, np.ones_like(a)) == 100.0
    perm = np.random.default_rng(2).permutation(len(a))
    assert nm.dot(a[perm], np.ones_like(a)) == 100.0
    M = np.stack([a, a[perm]])
    assert nm.matvec(M, np.ones_like(a)).tolist() == [100.0, 100.0]


@settings(max_examples=examples(50), deadline=None, derandomize=True)
@given(problems())
def test_the_fit_does_not_depend_on_the_order_of_its_rows(prob):
    A, b = prob
    perm = np.random.default_rng(A.shape[0]).permutation(A.shape[0])
    x1, x2 = nm.nnls(A, b), nm.nnls(A[perm], b[perm])
    np.testing.assert_allclose(x1, x2, rtol=1e-9, atol=1e-12)


def test_elementwise_functions_are_the_c_librarys():
    x = np.linspace(-3.0, 3.0, 101)
    assert nm.exp(x).tolist() == [math.exp(v) for v in x.tolist()]
    assert nm.log1p(np.abs(x)).tolist() == [math.log1p(v) for v in np.abs(x).tolist()]
    assert nm.power(0.96875, np.abs(x) * 10).tolist() == [0.96875 ** v for v in (np.abs(x) * 10).tolist()]
    assert nm.exp(np.zeros((2, 3))).shape == (2, 3) and nm.exp(0.5) == math.exp(0.5)
