"""`evolving bench planner --timings FILE`: model forms fitted on measured iterations, the forms
that the data asks for win on held-back iterations, and bad files say what and where."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.drivers.bench import timings as tm


def _prefill_rows(rng, n, floor=256):
    rows = []
    for _ in range(n):
        b = int(rng.integers(1, 3))
        uc = rng.integers(4, 700, size=b)
        c = rng.integers(0, 4096, size=b)
        a_new = float(np.sum(uc * (uc + 1) / 2))
        a = float(np.sum(uc * c)) + a_new
        # compute-bound above `floor` new tokens, weight-read-bound below it
        y = 0.004 + 2e-5 * max(float(uc.sum()), floor) + 3e-10 * a
        y *= 1 + 0.02 * rng.uniform(-1, 1)
        rows.append(tm.Timing(phase="prefill", duration_s=y, batch=b, sum_t_uc=float(uc.sum()), sum_A=a,
                              sum_t_c=float(c.sum()), sum_A_new=a_new))
    return rows


def _decode_rows(rng, n):
    rows = []
    for _ in range(n):
        b = int(rng.integers(1, 33))
        ctx = float(np.exp(rng.uniform(np.log(64), np.log(16384), size=b)).round().sum())
        y = (0.006 + 1e-4 * b + 5e-8 * ctx) * (1 + 0.02 * rng.uniform(-1, 1))  # dense: context term
        rows.append(tm.Timing(phase="decode", duration_s=y, batch=b, sum_ctx=ctx))
    return rows


def test_forms_the_data_asks_for_win_on_held_back_iterations():
    rng = np.random.default_rng(3)
    table = tm.fit_table(_prefill_rows(rng, 400) + _decode_rows(rng, 400))
    pre = {m["model"]: m for m in table["prefill"]["models"]}
    dec = {m["model"]: m for m in table["decode"]["models"]}
    assert set(pre) == {"naive", "eq1", "eq1+req", "eq1+split", "eq1+floor"}
    assert pre["eq1+floor"]["floor_tokens"] == 256
    assert pre["eq1+floor"]["holdout_mape"] < 0.03 and pre["eq1+floor"]["cv_mape"] < 0.03
    assert pre["eq1+floor"]["holdout_mape"] < 0.5 * pre["eq1"]["holdout_mape"]
    assert pre["naive"]["holdout_mape"] > 3 * pre["eq1+floor"]["holdout_mape"]
    assert table["prefill"]["best"] == "eq1+floor"
    assert dec["eq2+ctx"]["holdout_mape"] < 0.03
    assert dec["eq2+ctx"]["holdout_mape"] < 0.5 * dec["eq2"]["holdout_mape"]
    assert table["decode"]["best"] == "eq2+ctx"
    assert dec["eq2+ctx"]["naive_over_this"] > 1.0


def test_the_split_form_says_why_it_is_not_fitted_without_the_new_pairs_column():
    rng = np.random.default_rng(1)
    rows = [tm.Timing(**{**{f: getattr(r, f) for f in r.__slots__}, "sum_A_new": None if i % 7 == 0 else r.sum_A_new})
            for i, r in enumerate(_prefill_rows(rng, 60))]
    models = {m["model"]: m for m in tm.fit_table(rows)["prefill"]["models"]}
    assert "cv_mape" not in models["eq1+split"] and "cv_mape" in models["eq1"]
    assert models["eq1+split"]["status"] == "not fitted: needs sum_A_new, which 9 of 60 rows lack"
    assert "eq1+split    not fitted: needs sum_A_new" in tm.format_table(tm.fit_table(rows), "t")


def test_a_dense_models_eq2_has_no_phi_column_and_collinear_terms_are_named():
    rng = np.random.default_rng(2)
    rows = _decode_rows(rng, 80)
    dec = {m["model"]: m for m in tm.fit_table(rows)["decode"]["models"]}
    assert dec["eq2"]["terms"] == ["1", "B"] and dec["eq2+ctx"]["terms"] == ["1", "B", "ctx"]
    assert "eq2+bal" not in dec and not dec["eq2+ctx"]["dependent"]
    # a context that is always 100 tokens per request repeats the batch column
    same = [tm.Timing(phase="decode", duration_s=r.duration_s, batch=r.batch, sum_ctx=100.0 * r.batch) for r in rows]
    dec = {m["model"]: m for m in tm.fit_table(same)["decode"]["models"]}
    assert dec["eq2+ctx"]["dependent"] == ["ctx"]
    assert "collinear" in tm.format_table(tm.fit_table(same), "t")


def test_rows_the_fit_drops_are_not_scored():
    """A broken report (duration 0.5 ns) is left out of the fit; before, the hold-back errors and
    the floor's choice were computed on the unfiltered rows, misaligned with the fit's."""
    rng = np.random.default_rng(4)
    rows = _prefill_rows(rng, 100)
    rows[3] = tm.Timing(**{**{f: getattr(rows[3], f) for f in rows[3].__slots__}, "duration_s": 5e-10})
    table = tm.fit_table(rows)["prefill"]
    eq1 = next(m for m in table["models"] if m["model"] == "eq1")
    assert eq1["rows"] == 99 and eq1["dropped"] == 1 and table["usable"] == 99
    assert eq1["cv_mape"] < 0.2 and eq1["holdout_p90"] < 1.0


def _moe_decode_rows(rng, n, balanced):
    rows = []
    for _ in range(n):
        b = int(rng.integers(1, 65))
        phi = min(1.0, 8 * b / 256) if balanced else 1 - (1 - 8 / 256) ** b
        y = (0.008 + 0.02 * phi + 2e-4 * b) * (1 + 0.01 * rng.uniform(-1, 1))
        rows.append(tm.Timing(phase="decode", duration_s=y, batch=b, sum_ctx=0.0, k=8, E=256))
    return rows


@pytest.mark.parametrize("balanced", [False, True])
def test_the_routing_the_data_follows_wins_random_or_balanced(balanced):
    rng = np.random.default_rng(6)
    table = tm.fit_table(_moe_decode_rows(rng, 200, balanced))["decode"]
    dec = {m["model"]: m for m in table["models"]}
    assert table["best"] == ("eq2+bal" if balanced else "eq2")
    worse, better = ("eq2", "eq2+bal") if balanced else ("eq2+bal", "eq2")
    assert dec[better]["cv_mape"] < 0.5 * dec[worse]["cv_mape"]


def test_a_per_request_cost_is_found_by_its_form():
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(200):
        b = int(rng.integers(1, 9))
        uc = rng.integers(16, 400, size=b)
        a = float(np.sum(uc * (uc + 1) / 2))
        y = (0.004 + 2e-5 * float(uc.sum()) + 3e-10 * a + 0.003 * b) * (1 + 0.01 * rng.uniform(-1, 1))
        rows.append(tm.Timing(phase="prefill", duration_s=y, batch=b, sum_t_uc=float(uc.sum()), sum_A=a, sum_A_new=a))
    table = tm.fit_table(rows)["prefill"]
    pre = {m["model"]: m for m in table["models"]}
    assert table["best"] == "eq1+req" and pre["eq1+req"]["cv_mape"] < 0.5 * pre["eq1"]["cv_mape"]


@given(st.lists(st.tuples(st.sampled_from(["prefill", "decode"]), st.floats(1e-4, 10), st.integers(1, 64),
                          st.integers(0, 10**6)), min_size=1, max_size=30))
def test_csv_round_trip(items):
    rows = [tm.Timing(phase=p, duration_s=d, batch=float(b), sum_t_uc=float(x), sum_A=float(x) * 2,
                      sum_ctx=float(x) if p == "decode" else None) for p, d, b, x in items]
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".csv")
    os.close(fd)
    try:
        tm.write_timings(rows, path)
        back = tm.read_timings(path)
    finally:
        os.unlink(path)
    assert back == rows


@pytest.mark.parametrize("text,needle", [
    ("", "empty file"),
    ("phase,duration_s,batch\n", "no iterations"),
    ("phase,duration_s,batch,bogus\nprefill,1,1,2\n", "unknown column"),
    ("phase,batch\nprefill,1\n", "missing column"),
    ("phase,duration_s,batch,sum_t_uc,sum_A\nprefill,0.1,1,10,x\n", ":2: column 'sum_A' is not a number"),
    ("phase,duration_s,batch,sum_t_uc,sum_A\nprefill,0.1,1,10,5\nprefill,0,1,10,5\n", ":3: duration_s must be > 0"),
    ("phase,duration_s,batch\nprefill,0.1,1\n", "has no 'sum_t_uc'"),
    ("phase,duration_s,batch\nverify,0.1,1\n", "phase must be"),
    ("phase,duration_s,batch,sum_ctx\ndecode,0.1,-1,3\n", "negative value"),
])
def test_bad_files_say_what_and_where(text, needle):
    with pytest.raises(tm.TimingsError, match=needle.replace("(", r"\(")):
        tm.parse_timings(text, "f.csv")


def test_cli_prints_the_table_and_refuses_bad_files(tmp_path):
    rng = np.random.default_rng(5)
    good = tmp_path / "t.csv"
    tm.write_timings(_prefill_rows(rng, 50) + _decode_rows(rng, 50), good)
    cmd = [sys.executable, "-m", "services.drivers.cli", "bench", "planner", "--timings"]
    r = subprocess.run(cmd + [str(good), "--json"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fits"]["decode"]["best"] == "eq2+ctx"
    bad = tmp_path / "bad.csv"
    bad.write_text("phase,duration_s\n")
    r = subprocess.run(cmd + [str(bad)], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "missing column" in r.stderr and "bad.csv" in r.stderr
    r = subprocess.run(cmd + [str(tmp_path / "absent.csv")], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read" in r.stderr
