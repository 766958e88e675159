"""The simulated node's iteration noise has mean 1 (engine/backends/sim/node.py
``clipped_noise_mean``): clipping the factor at 0.5 no longer makes a noisy profile's
iterations slower on average than its coefficients say, and a 3% profile draws what it drew."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.sim.node import clipped_noise_mean


@pytest.mark.parametrize("rel", [0.0001, 0.03, 0.05])
def test_small_noise_divides_by_exactly_one(rel):
    assert clipped_noise_mean(rel) == 1.0  # the GB300 profiles' draws are unchanged, bit for bit


@pytest.mark.parametrize("rel", [0.3, 0.5, 0.8, 1.5])
def test_the_clipped_factor_divided_by_its_mean_averages_one(rel):
    z = np.random.default_rng(7).standard_normal(1_000_000)
    factor = np.maximum(0.5, 1.0 + rel * z) / clipped_noise_mean(rel)
    assert factor.mean() == pytest.approx(1.0, abs=3e-3 * max(1.0, rel))
    raw = np.maximum(0.5, 1.0 + rel * z).mean()  # without the division: biased up, by this mean
    assert raw > 1.005 and raw == pytest.approx(clipped_noise_mean(rel), abs=3e-3 * max(1.0, rel))
