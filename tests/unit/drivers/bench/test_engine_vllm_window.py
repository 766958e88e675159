"""The vLLM column's decode window (services/drivers/bench/engine_vllm.py): only the tokens that
arrived while every request decoded count, so a request admitted late does not make the rate
one of a smaller batch."""

from __future__ import annotations

import pytest

from services.drivers.bench.engine_vllm import decode_rate


def test_window_runs_from_the_last_first_token_to_the_first_last_token():
    # a: first token at 0, then one every 0.1 s; b: admitted two steps late
    a = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    b = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    rate, n, secs = decode_rate([a, b])
    assert secs == pytest.approx(0.3)  # 0.2 .. 0.5
    assert n == 6  # a: 0.3 0.4 0.5, b: 0.3 0.4 0.5
    assert rate == pytest.approx(20.0)


def test_requests_that_never_overlap_are_refused():
    with pytest.raises(RuntimeError, match="did not overlap"):
        decode_rate([[0.0, 0.1, 0.2], [0.3, 0.4, 0.5]])
