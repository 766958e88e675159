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
    assert set(pre) == {"naive", "eq1", "eq1+split", "eq1+floor"}
    assert pre["eq1+floor"]["floor_tokens"] == 256
    assert pre["eq1+floor"]["holdout_mape"] < 0.03
    assert pre["eq1+floor"]["holdout_mape"] < 0.5 * pre["eq1"]["holdout_mape"]
    assert pre["naive"]["holdout_mape"] > 3 * pre["eq1+floor"]["holdout_mape"]
    assert table["prefill"]["best"] == "eq1+floor"
    assert dec["eq2+ctx"]["holdout_mape"] < 0.03
    assert dec["eq2+ctx"]["holdout_mape"] < 0.5 * dec["eq2"]["holdout_mape"]
    assert table["decode"]["best"] == "eq2+ctx"
    assert dec["eq2+ctx"]["naive_over_this"] > 1.0


def test_no_split_form_without_the_new_pairs_column():
    rng = np.random.default_rng(1)
    rows = [tm.Timing(**{**{f: getattr(r, f) for f in r.__slots__}, "sum_A_new": None})
            for r in _prefill_rows(rng, 60)]
    names = [m["model"] for m in tm.fit_table(rows)["prefill"]["models"]]
    assert "eq1+split" not in names and "eq1" in names


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
