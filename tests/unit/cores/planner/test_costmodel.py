"""Eq. 1 / eq. 2 cost models and their NNLS fit (METHOD.md §4.2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.cores.costmodel import (
    PRIOR_DECODE,
    PRIOR_PREFILL,
    DecodeModel,
    PrefillModel,
    fit_decode,
    fit_prefill,
    min_samples,
    phi,
    prefill_A,
)

TRUE_P = PrefillModel(c0=0.015, c1=4.0e-5, c2=2.0e-10, c3=3.0e-6)
TRUE_D = DecodeModel(d0=0.010, d1=0.020, d2=4.0e-4, k=8, E=256)


def prefill_samples(n: int, noise: float, seed: int, model: PrefillModel = TRUE_P) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        reqs = int(rng.integers(1, 9))
        t_uc = rng.integers(16, 4096, size=reqs)
        t_c = rng.integers(0, 120_000, size=reqs) * (rng.random(reqs) < 0.8)
        t_rst = (t_c * rng.random(reqs) * (rng.random(reqs) < 0.5)).astype(int)
        s_uc, s_A, s_rst = (
            int(t_uc.sum()),
            float(sum(prefill_A(u, c) for u, c in zip(t_uc, t_c))),
            int(t_rst.sum()),
        )
        y = model.iteration_s(s_uc, s_A, s_rst) * (1 + noise * rng.uniform(-1, 1))
        rows.append((s_uc, s_A, s_rst, y))
    return rows


def decode_samples(n: int, noise: float, seed: int, model: DecodeModel = TRUE_D) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        B = int(rng.integers(1, 129))
        t_fwd = float(rng.choice([1.0, 2.0, 3.0]))
        rows.append((B, t_fwd, model.iteration_s(B, t_fwd) * (1 + noise * rng.uniform(-1, 1))))
    return rows


def test_prefill_A_counts_causal_pairs():
    # brute force: new token i (1-based) sees t_c cached tokens and i new ones (itself included)
    for t_uc, t_c in [(1, 0), (5, 0), (5, 7), (64, 1000)]:
        assert prefill_A(t_uc, t_c) == sum(t_c + i for i in range(1, t_uc + 1))


def test_chunked_request_time_matches_iterations():
    m = PrefillModel(0.01, 1e-5, 1e-9, 1e-6)
    # 10 000 new tokens, budget 4096 -> chunks 4096, 4096, 1808
    expected = (
        m.iteration_s(4096, prefill_A(4096, 500), 300)
        + m.iteration_s(4096, prefill_A(4096, 4596), 0)
        + m.iteration_s(1808, prefill_A(1808, 8692), 0)
    )
    assert m.request_s(10_000, 500, t_rst=300, token_budget=4096) == pytest.approx(expected)
    # chunking changes only the count of fixed costs: total A is the same as one big chunk
    one = m.request_s(10_000, 500, 300, token_budget=10_000)
    assert m.request_s(10_000, 500, 300, token_budget=4096) - one == pytest.approx(2 * m.c0)
    # a fully cached request still takes one iteration
    assert m.request_s(0, 5000) == pytest.approx(m.c0)


def test_decode_request_time_and_phi():
    assert phi(0, 2.0, 8, 256) == 0.0
    assert phi(1, 1.0, 8, 256) == pytest.approx(8 / 256)
    assert phi(10_000, 1.0, 8, 256) == pytest.approx(1.0)
    m = TRUE_D
    assert m.request_s(100, 1.7, 32, 2.0) == pytest.approx(math.ceil(100 / 1.7) * m.iteration_s(32, 2.0))
    assert m.throughput_rps(100, 1.0, 32) == pytest.approx(32 / (100 * m.iteration_s(32)))


def test_priors_match_documented_decode_range():
    # METHOD.md §4.2: 17-45 ms per iteration at 8-64 requests (t_fwd 2 with MTP)
    assert 0.015 <= PRIOR_DECODE.iteration_s(8, 2.0) <= 0.025
    assert 0.040 <= PRIOR_DECODE.iteration_s(64, 2.0) <= 0.050
    assert all(c > 0 for c in PRIOR_PREFILL.coefficients)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_nnls_recovers_prefill_coefficients_with_5pct_noise(seed):
    fit = fit_prefill(prefill_samples(2000, 0.05, seed))
    assert fit.fitted, fit.status
    for got, true in zip(fit.coefficients, TRUE_P.coefficients):
        assert got == pytest.approx(true, rel=0.03)
    assert fit.mape < 0.04  # uniform +-5 % noise has a mean absolute error of 2.5 %
    assert fit.samples == 2000


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_nnls_recovers_decode_coefficients_with_5pct_noise(seed):
    fit = fit_decode(decode_samples(2000, 0.05, seed), k=8, E=256)
    assert fit.fitted, fit.status
    for got, true in zip(fit.coefficients, TRUE_D.coefficients):
        assert got == pytest.approx(true, rel=0.03)
    assert fit.mape < 0.04


def test_coefficients_never_negative_even_when_data_pull_them_down():
    # durations that *fall* with more tokens would need a negative c1: NNLS clamps it to 0
    rows = [(u, prefill_A(u, 0), 0, max(0.001, 0.5 - 1e-4 * u)) for u in range(100, 4000, 100)]
    fit = fit_prefill(rows)
    assert fit.fitted and min(fit.coefficients) >= 0.0
    drows = [(b, 1.0, max(0.001, 0.05 - 3e-4 * b)) for b in range(1, 100, 3)]
    dfit = fit_decode(drows)
    assert dfit.fitted and min(dfit.coefficients) >= 0.0


def test_too_few_samples_is_a_not_fitted_state():
    for n in (0, 1, min_samples() - 1):
        fit = fit_prefill(prefill_samples(n, 0.05, 0))
        assert not fit.fitted and fit.coefficients == []
        assert fit.status.startswith("not fitted yet") and fit.samples == n
        assert not fit_decode(decode_samples(n, 0.05, 0)).fitted
    assert fit_prefill(prefill_samples(min_samples(), 0.0, 0)).fitted


def test_garbage_rows_are_ignored_not_fatal():
    rows = prefill_samples(50, 0.0, 4) + [(1, 1, 0, 0.0), (1, 1, 0, float("nan")), (1, 1, 0, -1.0)]
    fit = fit_prefill(rows)
    assert fit.fitted and fit.samples == 50


def test_unobserved_restore_column_keeps_prior():
    rows = [(u, a, 0, TRUE_P.iteration_s(u, a, 0)) for (u, a, _, _) in prefill_samples(100, 0.0, 5)]
    fit = fit_prefill(rows)
    assert fit.unidentified == [3]
    assert fit.coefficients[3] == PRIOR_PREFILL.c3
    assert fit.coefficients[1] == pytest.approx(TRUE_P.c1, rel=1e-3)


def test_the_decode_fit_learns_the_context_term_when_iterations_report_context():
    """Eq. 2 plus ``d3 * sum_ctx``: iterations that report the context they attend over identify
    d3; without context (all 0) d3 is unidentified and stays the prior's 0, the rest as before."""
    true = DecodeModel(d0=0.010, d1=0.020, d2=4.0e-4, k=8, E=256, d3=2.0e-8)
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(300):
        B = int(rng.integers(1, 65))
        ctx = float(B * rng.integers(100, 20_000))
        rows.append((B, 1.0, ctx, true.iteration_s(B, 1.0, ctx) * (1 + 0.01 * rng.uniform(-1, 1))))
    fit = fit_decode(rows, k=8, E=256)
    assert fit.fitted and len(fit.coefficients) == 4
    assert fit.coefficients[3] == pytest.approx(true.d3, rel=0.05)
    assert fit.mape < 0.02
    without = fit_decode([(b, f, 0.0, y) for b, f, _, y in rows], k=8, E=256)
    assert without.unidentified == [3] and without.coefficients[3] == 0.0 and without.mape > fit.mape
    # rows without a context column (logs and snapshots before the term) fit as context 0
    assert fit_decode([(b, f, y) for b, f, _, y in rows], k=8, E=256).coefficients == without.coefficients


def test_a_decode_model_from_three_coefficients_has_no_context_term():
    m = DecodeModel.of([0.01, 0.02, 4e-4], k=8, E=256)
    assert m.d3 == 0.0 and m.coefficients == [0.01, 0.02, 4e-4, 0.0]
    m4 = DecodeModel.of([0.01, 0.02, 4e-4, 1e-8], k=8, E=256)
    assert m4.request_s(10, 1.0, 4, context=1000) == pytest.approx(10 * (m.iteration_s(4) + 1e-8 * 4000))
    assert m4.throughput_rps(10, 1.0, 4, context=1000) < m.throughput_rps(10, 1.0, 4, context=1000)
