"""The sim engine ends its turn like a model (engine/backends/sim/lengths.py): a deterministic
output length per request, fitted on the bundled real Claude Code sessions, capped by max_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.backends.sim.lengths import (
    DEFAULT_OUTPUT_TOKENS,
    PROBS,
    fit_output_tokens,
    sim_output_tokens,
    unit,
)
from replay.traces.fit import workload_samples
from replay.traces.importers.weka import import_weka

CALIBRATION = Path(__file__).resolve().parents[3] / "deploy" / "traces" / "calibration"


def test_default_is_the_fit_on_the_bundled_traces():
    sessions = import_weka(CALIBRATION).sessions
    outputs = workload_samples(sessions).dists["output tokens"]
    assert (len(sessions), len(outputs)) == (34, 2610)
    assert fit_output_tokens(outputs) == DEFAULT_OUTPUT_TOKENS
    assert DEFAULT_OUTPUT_TOKENS.p == PROBS


def test_the_request_id_decides_the_length():
    a = [sim_output_tokens(f"b/{i}", 64_000, ignore_eos=False) for i in range(2000)]
    assert a == [sim_output_tokens(f"b/{i}", 64_000, ignore_eos=False) for i in range(2000)]
    assert len(set(a)) > 300 and min(a) >= 1
    s = sorted(a)
    assert 180 <= s[len(s) // 2] <= 250  # the fitted median is 212
    assert 0.0 < unit("x") < 1.0 and unit("x") != unit("y")


@pytest.mark.parametrize(("max_tokens", "osl", "ignore_eos", "want"), [
    (64_000, 0, True, 64_000),  # benchmarks: the whole budget
    (64_000, 0, None, 64_000),  # not said (a trace driver): the recorded length is the budget
    (64_000, 300, False, 300),  # the harness's expected length
    (100, 300, False, 100),  # capped by the budget
    (0, 0, True, 1),
])
def test_precedence(max_tokens, osl, ignore_eos, want):
    assert sim_output_tokens("b/1", max_tokens, osl=osl, ignore_eos=ignore_eos) == want


def test_capped_by_max_tokens():
    assert all(sim_output_tokens(f"r{i}", 8, ignore_eos=False) <= 8 for i in range(500))
    assert any(sim_output_tokens(f"r{i}", 64_000, ignore_eos=False) < 200 for i in range(50))
