"""Calibration: workload samples, the CC fit, KS comparison, `trace fit` and `stats --compare`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from replay.cli import load_workload
from replay.traces.fit import SAMPLE_DOC, compare, fit_cc, format_compare, ks_distance, workload_samples
from replay.traces.format import Fork
from replay.traces.importers.weka import import_weka
from replay.traces.workloads import CcParams, generate, load_cc_params
from services.drivers.cli import main

ROOT = Path(__file__).resolve().parents[4]
WEKA = ROOT / "tests" / "fixtures" / "traces" / "weka-claude-code"
CAL = ROOT / "tests" / "fixtures" / "traces" / "weka-claude-code-calibration"
# calibration sessions with sub-agents (0003), compactions and resumes
FEW = ["trace_0003.json.gz", "trace_0013.json.gz", "trace_0016.json.gz", "trace_0021.json.gz",
       "trace_0028.json.gz", "trace_0042.json.gz"]


def test_samples_of_the_real_fixtures_match_their_structure():
    sessions = import_weka(WEKA).sessions
    sm = workload_samples(sessions)
    d = sm.dists
    assert set(d) == set(SAMPLE_DOC)
    n_req = sum(1 for s in sessions for _ in s.requests())
    assert len(d["prompt tokens"]) == len(d["output tokens"]) == n_req == 90
    assert len(d["first prompt"]) == 3 and len(d["sub-agent requests"]) == 2
    assert sorted(d["sub-agent requests"]) == [5, 7]
    # trace_0202's compaction: 71,099 tokens before, 19,292 after (its full blocks: 301 x 64)
    assert d["compaction trigger"] == [71099] and d["compaction summary"] == [301 * 64]
    assert sm.resumes == sum(isinstance(st, Fork) for s in sessions for b in s.branches for st in b.steps) == 2
    assert len(d["tool pause s"]) + len(d["human pause s"]) == sm.tool + sm.human
    assert all(g > 0 for g in d["growth per turn"])
    r = sm.rates()
    assert r["compactions per session"] == pytest.approx(1 / 3)
    assert 0 < r["human share"] < 1


def test_compare_a_workload_with_itself_is_zero_and_with_another_is_not():
    a = generate("cc", seed=1, agents=20)
    rows, rates = compare(a, a)
    assert all(r.ks in (0.0, None) for r in rows)
    assert all(x == y for x, y in rates.values())
    rows, _ = compare(a, generate("osworld", seed=1, agents=10))
    by = {r.name: r for r in rows}
    assert by["prompt tokens"].ks > 0.5 and by["compaction trigger"].ks is None
    assert ks_distance([1, 2, 3], []) is None
    text = format_compare(rows, rates, "A", "B")
    assert "prompt tokens" in text and "KS" in text
    md = format_compare(rows, rates, "A", "B", markdown=True)
    assert md.count("\n|") > len(SAMPLE_DOC)


def test_fit_reproduces_the_data_it_was_fitted_on():
    sessions = import_weka(CAL / FEW[0]).sessions + [s for f in FEW[1:] for s in import_weka(CAL / f).sessions]
    p = fit_cc(sessions)
    assert isinstance(p, CcParams) and p != CcParams()
    gen = generate("cc", seed=3, agents=60, params=p)
    rows, rates = compare(sessions, gen)
    ks = {r.name: r.ks for r in rows}
    # marginals the generator draws directly reproduce the fitted samples
    for name in ("growth per turn", "output tokens", "tool pause s"):  # hundreds of samples each
        assert ks[name] is not None and ks[name] < 0.1, (name, ks[name])
    assert ks["main requests"] < 0.5  # 6 sessions: the KS 5% critical value is ~0.55
    assert abs(rates["resumes per main request"][1] - rates["resumes per main request"][0]) < 0.02
    assert abs(rates["human share"][1] - rates["human share"][0]) < 0.05


def test_trace_fit_writes_the_file_the_generator_loads(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["trace", "fit", str(WEKA), "-o", str(out), "--check-agents", "20"]) == 0
    text = capsys.readouterr().out
    assert "fitted the CC generator to 3 session(s)" in text and "KS" in text
    doc = json.loads(out.read_text())
    assert doc["command"] == f"evolving trace fit {WEKA} -o {out}" and doc["sessions"] == 3
    assert set(doc["fit"]["ks"]) == set(SAMPLE_DOC)
    p = load_cc_params(out)
    assert p == fit_cc(import_weka(WEKA).sessions)
    # the spec syntax loads it
    sessions, _ = load_workload(f"gen:cc:agents=4:seed=2:params={out}")
    assert len(sessions) == 4 and sessions == generate("cc", seed=2, agents=4, params=p)


def test_workload_specs(tmp_path):
    a, label = load_workload("gen:putnam:agents=3:seed=1:pace=scale:2")
    base = generate("putnam", seed=1, agents=3)
    assert label.startswith("gen:putnam") and len(a) == 3
    assert [r.pause_s for _b, _i, r in a[0].requests()] == pytest.approx(
        [2 * r.pause_s for _b, _i, r in base[0].requests()], abs=2e-3)
    moon, _ = load_workload(f"mooncake:{ROOT / 'tests/fixtures/traces/mooncake/synthetic_trace_head300.jsonl'}")
    assert sum(1 for s in moon for _ in s.requests()) == 300
    gz = tmp_path / "w"
    gz.mkdir()
    (gz / "t.json.gz").write_bytes(gzip.compress((WEKA / "trace_0504.json").read_bytes()))
    assert len(load_workload(str(gz))[0]) == 1
    for bad, msg in [("gen:nope", "gen:NAME"), ("gen:cc:agents", "agents=N"), ("gen:cc:agents=x", "integers"),
                     ("gen:putnam:params=x.json", "gen:cc only"), ("gen:cc:params=/nonexistent.json", "no params file")]:
        with pytest.raises(ValueError, match=msg):
            load_workload(bad)


def test_stats_compare_cli(tmp_path, capsys):
    assert main(["trace", "stats", "--compare", str(WEKA), "gen:cc:agents=10:seed=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"A = {WEKA} (3 sessions)") and "B = gen:cc:agents=10:seed=1 (10 sessions)" in out
    assert "growth per turn" in out and "human share" in out
    assert main(["trace", "stats", "--compare", str(WEKA), "gen:nope"]) == 1
    assert "bad workload spec 'gen:nope'" in capsys.readouterr().err
    assert main(["trace", "stats"]) == 2


def test_stats_reads_gzipped_kv_cache_tester_sessions_without_from(tmp_path, capsys):
    (tmp_path / "t.json.gz").write_bytes(gzip.compress((WEKA / "trace_0291.json").read_bytes()))
    assert main(["trace", "stats", str(tmp_path)]) == 0
    assert "requests 32 " in capsys.readouterr().out
    assert main(["trace", "stats", str(tmp_path / "t.json.gz")]) == 0


def test_bundled_fit_file_is_consistent():
    """replay/traces/cc_params.json holds what its recorded command wrote: the parameters the generator
    loads and the rates it measured on the data agree (a re-fit takes ~20 s: see docs/traces.md)."""
    doc = json.loads((ROOT / "replay" / "traces" / "cc_params.json").read_text())
    assert doc["command"] == f"evolving trace fit {doc['source']} -o replay/traces/cc_params.json"
    p = load_cc_params()
    rates = doc["fit"]["rates"]
    assert p.long_context_p == pytest.approx(rates["long-context share"][0], abs=1e-4)
    assert p.human_p == pytest.approx(rates["human share"][0], abs=1e-4)
    assert p.resume_p == pytest.approx(rates["resumes per main request"][0], abs=1e-4)
    assert all(v is not None and 0 <= v < 0.6 for v in doc["fit"]["ks"].values())
