"""aiperf 0.13 (NVIDIA's load generator, the one Dynamo's, vLLM's and SGLang's users run) against
``evolving up``, unchanged: a synthetic streaming run with ``--per-chunk-usage``, a multi-turn run
(one branch per conversation, read from aiperf's ``X-Session-Affinity``), and a ``mooncake_trace``
replay of bundled real sessions exported as ``mooncake-delta``; each with 0 errors and neither of
aiperf's warnings: no "Token Count Discrepancy" (its client-side counts, with the bundled model's
tokenizer and chat template, against our ``usage``: within 1% here) and no "Output Sequence Length
Mismatch". Plus our delta export read by aiperf's own row model and loader. aiperf lives in ``.venv-aiperf``
(``bash scripts/install_aiperf.sh``); ``pytest -m aiperf``. Figures: docs/benchmarking.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from services.drivers.up.testing import stop_up, wait_ready_file

pytestmark = pytest.mark.aiperf

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("EI_AIPERF_VENV", REPO / ".venv-aiperf"))  # another install: its venv
AIPERF = VENV / "bin" / "aiperf"
BUNDLED = REPO / "deploy" / "traces" / "calibration"


@pytest.fixture(scope="module")
def aiperf() -> Path:
    if not AIPERF.exists():
        pytest.skip(f"{AIPERF} is missing: bash scripts/install_aiperf.sh")
    return AIPERF


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """The bundled model's tokenizer and chat template as a Hugging Face folder (aiperf loads one
    by path: no network), the one ``evolving up``'s gateway counts with (``--tokenizer auto``)."""
    from engine.model_files import smollm2_gguf
    from services.drivers.gateway.hf_export import export_tokenizer

    return export_tokenizer(smollm2_gguf(), tmp_path_factory.mktemp("tokenizer"), model_max_length=262_144)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


#: the panels aiperf prints when its counts disagree with ours or outputs miss their requested length
WARNINGS = ("Token Count Discrepancy", "Output Sequence Length Mismatch")


def _profile(aiperf: Path, url: str, tokenizer: Path, out: Path, *args: str) -> dict:
    """One ``aiperf profile`` run, as docs/benchmarking.md gives it: client-side token counts with
    the chat template (``--apply-chat-template``), outputs at their requested length
    (``ignore_eos``); its summary, checked for errors and warnings."""
    cmd = [str(aiperf), "profile", "-m", "evolving-sim", "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer), "--apply-chat-template", "--extra-inputs", "ignore_eos:true",
           "--artifact-dir", str(out), "--ui-type", "none", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    said = r.stdout + r.stderr
    assert not [w for w in WARNINGS if w in said], said[-3000:]
    got = json.loads((out / "profile_export_aiperf.json").read_text())
    assert got["error_summary"] == [] and _avg(got, "osl_mismatch_count") == 0
    if "--use-server-token-count" not in args:  # else aiperf counts nothing itself (--per-chunk-usage needs it)
        # the counts aiperf computed and the usage we reported, request by request (its diff metrics)
        assert _avg(got, "usage_discrepancy_count") == 0
        assert _max(got, "usage_prompt_tokens_diff_pct") < 1.0 and _max(got, "usage_completion_tokens_diff_pct") < 1.0
    return got


def _avg(summary: dict, tag: str) -> float:
    m = summary.get(tag)
    return 0.0 if m is None else float(m.get("avg") or 0.0)  # a counter that never counted is left out


def _max(summary: dict, tag: str) -> float:
    assert tag in summary, f"aiperf computed no {tag}: {sorted(summary)}"
    return float(summary[tag]["max"])


def test_aiperf_runs_against_up(aiperf, tokenizer, nats_url, partition, tmp_path):
    trace = tmp_path / "trace.jsonl"
    _delta_trace(trace, sessions=3, turns=3)
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "2", "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = wait_ready_file(ready, up, 120)["gateway"]
        # synthetic, streaming: aiperf's own counts (the bundled model's tokenizer) agree with our usage
        syn = _profile(aiperf, url, tokenizer, tmp_path / "synthetic", "--synthetic-input-tokens-mean", "100",
                       "--output-tokens-mean", "16", "--request-count", "12", "--concurrency", "3")
        assert syn["request_count"]["avg"] == 12
        assert syn["output_sequence_length"]["min"] == syn["output_sequence_length"]["max"] == 16
        assert syn["input_sequence_length"]["avg"] == 100  # the chat template's tokens included, as asked
        # usage on every chunk (vLLM's continuous_usage_stats): aiperf then takes the server's counts
        per = _profile(aiperf, url, tokenizer, tmp_path / "per-chunk", "--per-chunk-usage", "--use-server-token-count",
                       "--synthetic-input-tokens-mean", "100",
                       "--output-tokens-mean", "16", "--request-count", "12", "--concurrency", "3")
        assert per["request_count"]["avg"] == 12
        assert per["inter_token_latency"]["count"] == 12
        # multi-turn: 4 conversations of 3 turns, each one branch
        before = _metric(_get(url + "/metrics"), "ei_gateway_branches_opened_total")
        multi = _profile(aiperf, url, tokenizer, tmp_path / "multi", "--synthetic-input-tokens-mean", "100",
                         "--output-tokens-mean", "16", "--conversation-num", "4", "--conversation-turn-mean", "3",
                         "--conversation-turn-stddev", "0", "--concurrency", "2")
        assert multi["request_count"]["avg"] == 12
        after = _metric(_get(url + "/metrics"), "ei_gateway_branches_opened_total")
        assert after - before == 4
        # the bundled sessions' first turns, exported as deltas and replayed by aiperf
        rows = len(trace.read_text().splitlines())
        rep = _profile(aiperf, url, tokenizer, tmp_path / "trace", "--input-file", str(trace),
                       "--custom-dataset-type", "mooncake_trace", "--prompt-input-tokens-block-size", "64",
                       "--concurrency", "3", "--request-count", str(rows))
        assert rep["request_count"]["avg"] == rows
    finally:
        stop_up(up)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _delta_trace(path: Path, sessions: int, turns: int) -> list[dict]:
    """The first ``turns`` rows of the first ``sessions`` sessions of the bundled trace, as deltas."""
    from replay.traces.export import export_sessions
    from replay.traces.importers.spec import load_workload

    full = path.with_suffix(".all.jsonl")
    export_sessions(full, load_workload(str(BUNDLED)).sessions, "mooncake-delta")
    kept, count = [], {}
    for line in full.read_text().splitlines():
        r = json.loads(line)
        sid = r["session_id"]
        if sid not in count and len(count) == sessions:
            continue
        count[sid] = count.get(sid, 0) + 1
        if count[sid] <= turns:
            kept.append(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


LOADER = """
import json, sys
from collections import defaultdict
from aiperf.dataset.loader.models import MooncakeTrace
from aiperf.dataset.loader.mooncake_trace import MooncakeTraceDatasetLoader
sessions = defaultdict(list)
for line in open(sys.argv[1]):
    rec = json.loads(line)
    assert MooncakeTraceDatasetLoader.can_load(rec), rec
    t = MooncakeTrace.model_validate(rec)
    sessions[t.session_id].append([t.input_length, t.output_length, len(t.hash_ids or []), t.delay])
print(json.dumps(sessions))
"""


def test_aiperf_reads_our_delta_export(aiperf, tmp_path):
    """aiperf's own row model and loader accept every row, group the sessions as we wrote them,
    and every later turn is the new input only (far shorter than the cumulative prompt)."""
    rows = _delta_trace(tmp_path / "d.jsonl", sessions=34, turns=10**6)
    r = subprocess.run([str(VENV / "bin" / "python"), "-c", LOADER, str(tmp_path / "d.jsonl")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    want: dict[str, list] = {}
    for row in rows:
        want.setdefault(row["session_id"], []).append(
            [row["input_length"], row["output_length"], len(row["hash_ids"]), row.get("delay")])
    assert got == want and len(got) >= 34
    assert all(n_ids == -(-n // 64) for turns in got.values() for n, _o, n_ids, _d in turns)
