"""The fidelity workload (replay/fidelity/workload.py), the driver's id prompts and the
comparison's window, on the bundled real sessions."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from events.catalog import RequestFinished, RequestSubmitted, Tick
from replay.fidelity.compare import off_by, planner_offset_s, ranking, sim_warmup_s, window
from replay.fidelity.workload import Scaling, scale_session, scaled_sessions, workload_figures
from services.drivers.gateway.drive import synth_ids

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


@pytest.fixture(scope="module")
def real():
    from replay.traces.importers.spec import load_workload

    return load_workload(str(FIXTURES)).sessions


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_token_lengths_shrink_and_prefixes_stay_the_traces(real):
    sc = Scaling(turns=6, tokens=16, output=8, max_output=20, pause=0.1)
    s = real[0]
    small = scale_session(s, sc)
    big = [r for _, _, r in s.requests()][:6]
    got = [r for _, _, r in small.requests()]
    assert len(got) == len(big) and small.block_tokens == 64
    for r0, r1 in zip(big, got, strict=True):
        tokens0 = len(r0.blocks) * s.block_tokens + r0.tail_tokens
        tokens1 = len(r1.blocks) * 64 + r1.tail_tokens
        assert abs(tokens1 - tokens0 / 16) <= 64, (tokens0, tokens1)  # / 16, up to the merged leftover
        assert 1 <= r1.output_tokens <= 20
    for (a0, b0), (a1, b1) in zip(itertools.pairwise(big), itertools.pairwise(got), strict=True):
        # two prompts sharing m trace blocks of 64 share m // 16 merged blocks
        assert shared(a1.blocks, b1.blocks) == shared(a0.blocks, b0.blocks) * s.block_tokens // (64 * 16)


def test_scaled_sessions_fit_the_context_and_skip_the_calibration_ones(real):
    sc = Scaling(sessions=2, turns=3, tokens=64, context_tokens=8192)
    first = scaled_sessions(real, sc)
    after = scaled_sessions(real, Scaling(sessions=2, turns=3, tokens=64, skip=1))
    assert len(first) == 2 and after[0].id == first[1].id  # the held-out set starts after the skipped one
    for s in first:
        for _, _, r in s.requests():
            assert len(r.blocks) * 64 + r.tail_tokens + r.output_tokens <= 8192
    fig = workload_figures(first)
    assert fig["sessions"] == 2 and fig["requests"] == 6 and fig["prompt_tokens"] > 0


def test_id_prompts_have_exact_lengths_and_equal_blocks_give_equal_ids():
    a = synth_ids([11, 22], 5, 64, "r1", vocab=384)
    b = synth_ids([11, 33], 7, 64, "r2", vocab=384)
    assert len(a) == 133 and len(b) == 135
    assert a[:64] == b[:64] and a[64:128] != b[64:128]  # the shared block, then not
    assert all(384 // 8 <= x < 384 for x in a + b)  # clear of the control tokens, inside the vocabulary


def test_window_offset_and_ranking():
    ev = [Tick(ts=100.0, src="planner"),
          RequestSubmitted(ts=112.0, src="gw", request="a", branch="b", prompt_tokens=1, blocks=[]),
          RequestFinished(ts=130.0, src="n0", request="a", node="n0")]
    t0, t1 = window(ev)
    assert t0 == 112.0 and t1 == pytest.approx(130.0)
    assert planner_offset_s(ev) == 12.0
    assert sim_warmup_s(30.0, 12.0) == 18.0 and sim_warmup_s(10.0, 12.0) == 1.0
    assert off_by(2.0, 2.5) == 0.25 and off_by(0, 1.0) is None and off_by(None, 1.0) is None
    rows = [{"stack": "x", "metric": "throughput_rps", "live": 1.0, "sim": 2.0},
            {"stack": "y", "metric": "throughput_rps", "live": 1.5, "sim": 1.0}]
    assert ranking(rows) == (["y", "x"], ["x", "y"])
    assert not math.isnan(t1)


def test_the_calibration_sweep_is_cold_prompts_of_the_asked_lengths(real):
    """The calibration run's sweep: one request per length, whole blocks, no block shared with
    another sweep prompt or with any bundled session (so every token is prefilled)."""
    from replay.fidelity.workload import prefill_sweep

    sweep = prefill_sweep([512, 1000, 2048, 4096])
    reqs = [s.branches[0].steps[0] for s in sweep]
    assert [len(r.blocks) * 64 for r in reqs] == [512, 960, 2048, 4096]
    assert all(r.output_tokens == 4 and r.tail_tokens == 0 for r in reqs)
    blocks = [b for r in reqs for b in r.blocks]
    assert len(set(blocks)) == len(blocks)
    trace_blocks = {b for s in real for br in s.branches for st in br.steps if hasattr(st, "blocks") for b in st.blocks}
    assert trace_blocks and not trace_blocks & set(blocks)
    assert max(blocks) < 2**64


def test_ranking_ties_within_tolerance_are_ties():
    """The quiet run of 6 Dec: dynamo and static 1P1D are one configuration (identical simulated
    rows), live 0.752 and 0.767 req/s apart by 2%; that is a tie, not a rank change. A pair
    ordered one way live and the other way simulated beyond 5% still is one."""
    from replay.fidelity.compare import order, ranked, same_ranking

    def rows(live: dict, sim: dict) -> list[dict]:
        return [{"stack": s, "metric": "throughput_rps", "live": live[s], "sim": sim[s]} for s in live]

    quiet = rows({"evolving": 0.817, "dynamo": 0.752, "static:1P1D": 0.767},
                 {"evolving": 0.864, "dynamo": 0.662, "static:1P1D": 0.662})
    assert ranking(quiet)[0] == ["evolving", "static:1P1D", "dynamo"]  # the strict order differs ...
    assert ranking(quiet)[1] == ["evolving", "dynamo", "static:1P1D"]
    assert same_ranking(quiet)  # ... but 2% is within the tie
    assert ranked(["evolving", "static:1P1D", "dynamo"], quiet, "live") == "evolving > static:1P1D = dynamo"
    assert order(0.752, 0.767) == 0 and order(0.767, 0.70) == 1 and order(0.70, 0.767) == -1
    assert order(None, 1.0) == 0 and order(0.0, 0.0) == 0
    # 10% apart one way live and the other way simulated: a rank change
    swapped = rows({"a": 1.0, "b": 0.9}, {"a": 0.9, "b": 1.0})
    assert not same_ranking(swapped)
    assert same_ranking(swapped, tie=0.12)  # the tolerance is the caller's
    # evolving simulated below dynamo by more than 5% while live above it: different
    flipped = rows({"evolving": 0.817, "dynamo": 0.752}, {"evolving": 0.60, "dynamo": 0.662})
    assert not same_ranking(flipped)
