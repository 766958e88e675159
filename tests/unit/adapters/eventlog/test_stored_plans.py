"""The named views of a format-2/3 log are read with cheaper plans than their SQL says (the
prompts' block counts from the stored runs, the kinds without a block list from the stored rows
without the dictionary): on generated runs with every stored shape of list (runs, keyed runs,
bitmaps, empty), the ``mat_*`` tables a writer stores at close, the views a reader computes and
the plain SQL of each view over the same kind views have the same columns, types and rows."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import (
    FirstToken,
    KvEvicted,
    KvStored,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.adapters.eventlog import DuckDbEventLog
from services.adapters.eventlog.columnar import blocks_len_sql, blocks_sql, rows_from_sql
from services.adapters.eventlog.views import NAMED_VIEWS, _named_view_sql
from tests.hyp import examples


def _prompt(rng: random.Random, chain: list[int]) -> list[int]:
    """A prompt's list in one of the shapes the log stores differently."""
    shape = rng.randrange(5)
    if shape == 0:
        return []
    if shape == 1:  # a branch's chain: consecutive ids (plain runs)
        return chain[: rng.randint(1, len(chain))]
    if shape == 2:  # ascending hashes: keyed runs
        return sorted(rng.sample(chain, rng.randint(1, len(chain))))
    if shape == 3:  # a scattered ascending subset of many blocks: a bitmap where smaller
        return sorted(rng.sample(chain, max(1, len(chain) // 7)))
    return [rng.choice(chain) for _ in range(rng.randint(1, 20))]  # repeats, any order


def _run(seed: int, n_requests: int) -> list:
    rng = random.Random(seed)
    chain = [rng.getrandbits(64) for _ in range(rng.randint(8, 300))]
    evs, t = [], 0.0
    for i in range(n_requests):
        req, node = f"r{i}", f"n{rng.randrange(3)}"
        blocks = _prompt(rng, chain)
        evs.append(RequestSubmitted(ts=t, request=req, branch=f"b{i % 3}", version=rng.randrange(3), blocks=blocks,
                                    prompt_tokens=64 * len(blocks) + rng.randrange(64), max_tokens=rng.randrange(200)))
        if rng.random() < 0.2:
            evs.append(KvEvicted(ts=t, node=node, tier="L1", blocks=_prompt(rng, chain)))
        for _ in range(rng.randrange(3)):  # unrouted, routed, rerouted; some by a router in shadow
            evs.append(RouteDecided(ts=t, request=req, prefill_node=node, decode_node="n2", t_c=rng.randrange(10_000),
                                    t_uc=rng.randrange(100), policy=rng.choice(["evolving", "rr"]),
                                    shadow=rng.random() < 0.3, predicted_ttft_s=rng.random()))
        steps = rng.randrange(5)  # how far the request got
        if steps > 0:
            evs.append(RequestStarted(ts=t + 0.1, request=req, node=node, phase="prefill",
                                      cached_tokens=rng.randrange(1000)))
        if steps > 1:
            evs.append(KvStored(ts=t + 0.2, node=node, tier="L1", blocks=blocks))
            evs.append(FirstToken(ts=t + 0.3, request=req, node=node))
        if steps > 2:
            evs.append(RequestStarted(ts=t + 0.4, request=req, node="n2", phase="decode"))
        if steps > 3:
            evs.append(RequestFinished(ts=t + 1.0, request=req, node="n2", output_tokens=rng.randrange(1, 300),
                                       error=rng.choice(["", "", "cancelled"])))
        t += rng.random()
    return [(i + 1, "ei.default.x", e) for i, e in enumerate(evs)]


def _same(con, a: str, b: str) -> None:
    cols_a = [c[:2] for c in con.execute(f"DESCRIBE SELECT * FROM ({a})").fetchall()]
    cols_b = [c[:2] for c in con.execute(f"DESCRIBE SELECT * FROM ({b})").fetchall()]
    assert cols_a == cols_b
    for x, y in ((a, b), (b, a)):
        assert con.execute(f"SELECT count(*) FROM (({x}) EXCEPT ALL ({y}))").fetchone() == (0,), (x, y)


@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), n_requests=st.integers(1, 25))
def test_stored_tables_computed_views_and_the_plain_sql_have_the_same_rows(tmp_path_factory, seed, n_requests):
    rows = _run(seed, n_requests)
    for fmt in ("1", "2", "3"):
        path = tmp_path_factory.mktemp(f"f{fmt}") / "run.duckdb"
        with DuckDbEventLog(path, format=fmt) as log:
            log.append(rows)
        ro = DuckDbEventLog(path, read_only=True, use_materialized=False)
        try:
            con = ro.con
            assert ro.stale_views == ()  # the tables are current: what a reader would use
            for name, body in NAMED_VIEWS.items():
                _same(con, f"SELECT * FROM mat_{name}", f"SELECT * FROM {name}")
                _same(con, f"SELECT * FROM {name}", _named_view_sql(body))
            if fmt != "1":  # every row's block count without its list is the list's length
                (differ,) = con.execute(
                    f"SELECT count(*) FROM {rows_from_sql()} "
                    f"WHERE {blocks_len_sql(fmt)} IS DISTINCT FROM len({blocks_sql(fmt)})").fetchone()
                assert differ == 0
        finally:
            ro.close()


def test_the_generated_runs_hold_every_stored_shape(tmp_path):
    """The property above sees runs, keyed runs, bitmaps and empty lists among the prompts."""
    path = tmp_path / "run.duckdb"
    with DuckDbEventLog(path) as log:
        log.append(_run(1, 60))
    ro = DuckDbEventLog(path, read_only=True)
    try:
        shapes = ro.con.execute(
            "SELECT count(*) FILTER (block_starts IS NOT NULL AND block_segs IS NULL), "
            "count(*) FILTER (block_segs IS NOT NULL), count(*) FILTER (bitmap_bits IS NOT NULL), "
            "count(*) FILTER (block_starts IS NULL AND bitmap_bits IS NULL) "
            "FROM event_rows WHERE type = 'RequestSubmitted'").fetchone()
    finally:
        ro.close()
    assert all(n > 0 for n in shapes), shapes


def test_every_view_reads_the_same_rows_in_every_format(tmp_path):
    """A run with every shape of list, empty ones included, stored in formats 1, 2 and 3: each
    kind view and each named view answers the same rows (an empty list reads [] and counts 0 in
    every format, not NULL in the columnar ones)."""
    from services.adapters.eventlog.views import EVENT_TYPES, view_name

    rows = _run(2, 40)
    assert any(isinstance(e, RequestSubmitted) and not e.blocks for _, _, e in rows)
    names = [view_name(t) for t in EVENT_TYPES] + list(NAMED_VIEWS)
    got = {}
    for fmt in ("1", "2", "3"):
        path = tmp_path / f"f{fmt}.duckdb"
        with DuckDbEventLog(path, format=fmt) as log:
            log.append(rows)
        with DuckDbEventLog(path, read_only=True, use_materialized=False) as ro:
            got[fmt] = {n: sorted(map(repr, ro.con.execute(f"SELECT * FROM {n}").fetchall())) for n in names}
    for n in names:
        assert got["1"][n] == got["2"][n] == got["3"][n], n
