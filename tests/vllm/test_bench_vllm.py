"""``evolving bench engine``'s vLLM column against a real vLLM server (``pytest -m vllm``): one
server on SmolLM2, the bench's prompts through its OpenAI API, a figure per batch size and for
prefill, the ratio ours / vLLM, and the server stopped afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def test_bench_engine_has_a_vllm_column_and_stops_its_server(hf_model):
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-m", "services.drivers.cli", "bench", "engine", "--json", "--batches", "1,4",
                          "--prompt", "40", "--steps", "6", "--prefill", "96", "--repeats", "1", "--threads", "1"],
                         check=False, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["vllm_skipped"] is None and r["vllm"]["dtype"] == "bfloat16" and r["vllm"]["threads"] == 1
    assert [row["batch"] for row in r["decode"]] == [1, 4]
    for row in r["decode"]:
        assert row["vllm_tok_s"] > 0 and row["vllm_ratio"] == pytest.approx(row["ours_tok_s"] / row["vllm_tok_s"])
    assert r["prefill"]["vllm_tok_s"] > 0
    # the server it launched is gone
    assert Path(r["vllm"]["log"]).stat().st_size > 0
    ps = subprocess.run(["ps", "-eo", "args"], check=True, capture_output=True, text=True).stdout
    assert str(Path(r["vllm"]["log"]).parent) not in ps and "--served-model-name bench" not in ps
