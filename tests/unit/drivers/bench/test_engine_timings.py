"""`evolving bench planner --engine torch`: the torch engine's own scheduler runs the grid and
every iteration it reports becomes a timing row whose sums are the requests' (tiny random
checkpoint, a small grid)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine.backends.torch.loader import Checkpoint, random_weights
from services.drivers.bench import engine_timings, timings
from tests.unit.engine.torch.cluster import TINY


def test_measured_rows_carry_the_grids_sums_and_fit():
    ck = Checkpoint(cfg=TINY, weights=random_weights(TINY, seed=1), tokenizer=None, path="tiny")
    grid = {"prefixes": (0, 128), "new": (16, 70), "parallel": (1, 2), "batches": (1, 3), "contexts": (64, 200)}
    seen = []
    rows, meta = engine_timings.measure(checkpoint=ck, repeats=3, seed=2, threads=1, grid=grid,
                                        progress=lambda i, n: seen.append((i, n)))
    assert seen[-1] == (len(seen), 3 * (8 + 4)) and meta["model"] == "tiny"
    pre = [r for r in rows if r.phase == "prefill"]
    dec = [r for r in rows if r.phase == "decode"]
    assert all(r.duration_s > 0 for r in rows)
    # every prefill of the grid: new tokens are one of the grid's sizes per request, and a cached
    # prefix shows up as cached tokens (only whole 64-token blocks are reused)
    assert {r.sum_t_uc for r in pre if r.batch == 1 and r.sum_t_c == 0} >= {16.0, 70.0}
    assert any(r.sum_t_c == 128 for r in pre)
    for r in pre:
        assert r.sum_A >= r.sum_t_uc * (r.sum_t_uc / r.batch + 1) / 2 - 1e-6
    # decode: batch sizes of the grid, context = what the batch attends over (> 32 tokens each)
    assert {r.batch for r in dec} == {1.0, 3.0}
    assert all(r.sum_ctx is not None and r.sum_ctx >= 32 * r.batch for r in dec)
    table = timings.fit_table(rows)
    assert {m["model"] for m in table["decode"]["models"]} == {"naive", "eq2", "eq2+ctx"}
