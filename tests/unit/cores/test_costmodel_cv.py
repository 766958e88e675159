"""cross_validated_ape: each row scored by a fit that never saw it."""

import numpy as np

from services.cores.costmodel import cross_validated_ape


def test_an_exact_linear_model_scores_zero_and_a_held_out_outlier_is_seen():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(40), rng.uniform(1, 10, 40)])
    y = X @ np.array([0.5, 2.0])
    assert np.allclose(cross_validated_ape(X, y, 5), 0.0, atol=1e-9)
    y2 = y.copy()
    y2[7] *= 3  # the outlier's own fold cannot have fitted it
    ape = cross_validated_ape(X, y2, 5)
    assert ape[7] > 0.5 and ape.argmax() == 7
