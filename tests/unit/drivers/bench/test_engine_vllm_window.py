"""The vLLM column's decode window (services/drivers/bench/engine_vllm.py): only the tokens that
arrived while every request decoded count, so a request admitted late does not make the rate
one of a smaller batch; a chunk that carries two tokens (vLLM holds back an incomplete UTF-8
character) counts two."""

from __future__ import annotations

import pytest

from services.drivers.bench.engine_vllm import decode_rate


def test_window_runs_from_the_last_first_token_to_the_first_last_token():
    # a: first token at 0, then one every 0.1 s; b: admitted two steps late
    a = [(0.1 * i, i + 1) for i in range(6)]
    b = [(0.2 + 0.1 * i, i + 1) for i in range(6)]
    rate, n, secs = decode_rate([a, b])
    assert secs == pytest.approx(0.3)  # 0.2 .. 0.5
    assert n == 6  # a: 0.3 0.4 0.5, b: 0.3 0.4 0.5
    assert rate == pytest.approx(20.0)


def test_requests_that_never_overlap_are_refused():
    with pytest.raises(RuntimeError, match="did not overlap"):
        decode_rate([[(0.0, 1), (0.1, 2), (0.2, 3)], [(0.3, 1), (0.4, 2), (0.5, 3)]])


def test_a_chunk_with_two_tokens_counts_two():
    a = [(0.0, 1), (0.1, 2), (0.3, 4), (0.4, 5)]  # 0.2's token held back and sent at 0.3
    b = [(0.0, 1), (0.1, 2), (0.2, 3), (0.3, 4), (0.4, 5)]
    rate, n, secs = decode_rate([a, b])
    assert (n, secs) == (8, pytest.approx(0.4)) and rate == pytest.approx(20.0)
