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


class _Staggered:
    """A server whose first ``bad`` batches come back one after another (no overlap), then together."""

    def __init__(self, bad: int):
        import threading

        self.bad, self.calls, self.tokens, self._lock = bad, 0, [], threading.Lock()

    def complete(self, prompt, max_tokens):
        with self._lock:
            self.calls += 1
            k = self.calls
            self.tokens.append(max_tokens)
        batch = (k - 1) // 2  # two prompts per batch
        off = (k - 1) % 2 if batch < self.bad else 0
        t0 = batch * 10_000.0 + off * 1_000.0
        return [(t0 + i, i + 1) for i in range(max_tokens)]


def test_a_batch_that_did_not_overlap_is_submitted_again_with_more_tokens_then_given_up():
    from services.drivers.bench import engine_vllm as ev

    s = _Staggered(bad=2)
    rate, n, secs = ev._overlapping_rate(s, [[1], [2]], 4)
    # two staggered batches (4, then 8 tokens each), then one together with 16 tokens each
    assert s.calls == 6 and s.tokens == [4, 4, 8, 8, 16, 16] and secs == 15.0 and n == 30 and rate == 2.0
    s = _Staggered(bad=ev.OVERLAP_TRIES)
    with pytest.raises(RuntimeError, match=f"in {ev.OVERLAP_TRIES} submissions"):
        ev._overlapping_rate(s, [[1], [2]], 4)
    assert s.calls == 2 * ev.OVERLAP_TRIES
