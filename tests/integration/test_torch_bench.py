"""``evolving bench engine`` on the tiny checkpoint: ours and transformers' ``LlamaForCausalLM``
(same weights, its ``DynamicCache`` passed back as ``past_key_values``) agree token for token
and each decode row carries wall and CPU figures for both. Needs the ``bench-engine`` extra."""

from __future__ import annotations

import pytest

from services.drivers.bench import engine as bench
from tests.unit.engine.torch.cluster import tiny_checkpoint

pytest.importorskip("transformers")


def test_bench_engine_agrees_with_transformers_and_reports_both_sides(tmp_path):
    ck = tiny_checkpoint(tmp_path / "tiny.gguf")
    r = bench.run(ck.path, batches=(1, 3), prompt=70, steps=4, prefill=40, repeats=1, linear="aten", vllm=False)
    assert r["greedy_agree"] is True and r["ours_linear"] == "aten"
    assert [row["batch"] for row in r["decode"]] == [1, 3]
    for row in r["decode"]:
        assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["ours_cpu_ms"] > 0 and row["hf_cpu_ms"] > 0
        assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["hf_tok_s"])
    assert r["prefill"]["tokens"] == 40 and r["prefill"]["ours_tok_s"] > 0
    assert "decode batch 3" in bench.format_report(r)
    assert r["vllm_skipped"] == "--no-vllm" and "no vLLM column: --no-vllm" in bench.format_report(r)
