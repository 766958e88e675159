"""The bench command runs end to end on a small stream (figures are printed, never asserted)."""

from __future__ import annotations

import argparse
import gzip
import json
import shutil

import pytest

from services.drivers.bench import cli
from services.drivers.bench import directory as bench


def test_the_real_sessions_are_found_in_a_bare_clone_too():
    assert bench.DEFAULT_TRACES.is_dir() and sorted(p.name for p in bench.DEFAULT_TRACES.glob("*.json*"))
    assert bench.FIXTURE_TRACES.is_dir()


def test_gzipped_sessions_read_like_plain_ones(tmp_path):
    for p in sorted(bench.FIXTURE_TRACES.glob("*.json")):
        shutil.copy(p, tmp_path / p.name)
        (tmp_path / (p.name + ".gz")).write_bytes(gzip.compress(p.read_bytes()))
        break
    (tmp_path / "zz_broken.json.gz").write_bytes(b"not gzip")
    plain = bench.load_workload(tmp_path, min_requests=1, min_blocks=1)  # stops before broken.json.gz
    assert plain.requests
    with pytest.raises(ValueError, match="zz_broken.json.gz: not a weka Claude Code trace"):
        bench.load_workload(tmp_path, min_requests=10**9, min_blocks=10**12)


def test_workload_replicates_with_distinct_namespaces_and_keeps_subagents():
    w = bench.load_workload(bench.FIXTURE_TRACES, min_requests=200, min_blocks=10_000)
    assert len(w.requests) >= 200
    branches = {r[1] for r in w.requests}
    assert any("/sa" in b for b in branches)  # sub-agents became their own branches
    assert all(r[3] == "subagent" and r[2] for r in w.requests if "/sa" in r[1])
    reps = {b.split("#")[1].split(":")[0] for b in branches}
    assert len(reps) >= 2
    first = {}
    for r in w.requests:  # the same local trace block in two replicas hashes differently
        first.setdefault(r[1].split("#")[0] + r[1].split(":")[1], set()).add(r[4][0])
    assert all(len(v) >= 2 for v in first.values() if v)


def test_bench_cli_prints_json_figures(capsys):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    b = sub.add_parser("bench").add_subparsers()
    cli.register(sub, b)
    args = p.parse_args(["bench", "directory", "--json", "--min-requests", "100", "--min-blocks", "5000",
                         "--repeats", "1", "--traces", str(bench.FIXTURE_TRACES)])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] >= 100 and out["prompt_blocks"] >= 5000
    for key in ("directory_blocks_per_s", "bare_dict_blocks_per_s", "ratio", "lookup_1000_p99_ms"):
        assert out[key] > 0
    assert out["anomalies"] == {}
    assert "ratio" in bench.format_report(out)
    assert out["cpus"] >= 1 and out["loadavg_1m_before"] >= 0 and "load average" in bench.format_report(out)


def test_sglang_input_renumbers_blocks_densely_per_request(tmp_path):
    import numpy as np

    steps = [([2**63 + 5, 7, 9], [], "a"), ([2**63 + 5, 7, 11, 13], [], "a")]
    bench._sglang_input(steps, tmp_path / "r.npz")
    data = np.load(tmp_path / "r.npz")
    assert data["ids"].tolist() == [0, 1, 2, 0, 1, 3, 4] and data["offsets"].tolist() == [0, 3, 7]


def test_a_broken_sglang_interpreter_is_one_clear_error(tmp_path):
    bench._sglang_input([([1, 2], [], "a")], tmp_path / "r.npz")
    with pytest.raises(RuntimeError, match="SGLang radix baseline failed under /bin/false"):
        bench._SglangRounds("/bin/false", tmp_path / "r.npz")


# A stand-in for SGLang's modules (the tests never import SGLang): a RadixCache that logs each
# round's start time, its calls, and checks every request is matched before it is inserted.
_FAKE = {
    "torch/__init__.py": "int64 = 'int64'\ndef arange(n, dtype=None):\n    return list(range(n))\n",
    "sglang/__init__.py": "", "sglang/srt/__init__.py": "", "sglang/srt/mem_cache/__init__.py": "",
    "sglang/srt/mem_cache/base_prefix_cache.py":
        "class MatchPrefixParams:\n    def __init__(self, key): self.key = key\n"
        "class InsertParams:\n    def __init__(self, key, value): self.key, self.value = key, value\n",
    "sglang/srt/mem_cache/cache_init_params.py":
        "class CacheInitParams:\n    def __init__(self, **kw): self.kw = kw\n",
    "sglang/srt/mem_cache/radix_cache.py": """
import os, time
LOG = os.environ["FAKE_SGLANG_LOG"]
class RadixKey:
    def __init__(self, token_ids): self.token_ids = token_ids
class RadixCache:
    def __init__(self, params):
        assert params.kw["page_size"] == 1
        self.matched, self.n = None, 0
        with open(LOG, "a") as f: f.write(f"S {time.perf_counter()}\\n")
    def match_prefix(self, p):
        self.matched = list(p.key.token_ids)
    def insert(self, p):
        assert list(p.key.token_ids) == self.matched and len(p.value) == len(self.matched)
        self.n += 1
""",
}


def test_sglang_rounds_alternate_with_the_directory_in_one_child(tmp_path, monkeypatch):
    import sys
    import time

    for rel, text in _FAKE.items():
        (tmp_path / "fake" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / rel).write_text(text)
    log = tmp_path / "rounds.log"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))
    fold = bench._fold_directory

    def logged(setup, steps):
        with open(log, "a") as f:
            f.write(f"D {time.perf_counter()}\n")
        return fold(setup, steps)

    monkeypatch.setattr(bench, "_fold_directory", logged)
    spawned = []
    popen = bench.subprocess.Popen
    monkeypatch.setattr(bench.subprocess, "Popen", lambda *a, **k: spawned.append(a) or popen(*a, **k))
    out = bench.run(bench.FIXTURE_TRACES, min_requests=60, min_blocks=2000, repeats=3, sglang_python=sys.executable)
    order = [line.split()[0] for line in sorted(log.read_text().splitlines(), key=lambda x: float(x.split()[1]))]
    # one child for the whole bench; rounds alternate, SGLang first in odd rounds (D S | S D | D S),
    # and the memory pass's fold (not timed against SGLang) comes last
    assert len(spawned) == 1
    assert order == ["D", "S", "S", "D", "D", "S", "D"]
    assert len(out["sglang_ratio_cpu_per_round"]) == 3
    assert abs(out["sglang_ratio_cpu_median_paired"] - sorted(out["sglang_ratio_cpu_per_round"])[1]) < 1e-3
    assert out["sglang_radix_blocks_per_cpu_s"] > 0 and out["sglang_radix_blocks_per_cpu_s_median"] > 0
    assert "x SGLang per round" in bench.format_report(out)
