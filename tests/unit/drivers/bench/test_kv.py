"""evolving bench kv: runs end to end on tiny pools and reports every path with its baseline."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kernels import ops
from services.drivers.bench import kv as bench
from services.drivers.cli import main


def test_bench_reports_each_path_against_its_baseline():
    result = bench.run(layout="bf16:2x2x2x8", num_slots=16, blocks=6, repeats=1, transfer=False)
    assert set(result["kernels"]) == {"gather[torch]", "scatter[torch]", "host_copy[pool->pool]"}
    for fig in result["kernels"].values():
        assert fig["bytes"] == 6 * 128
        assert fig["ours_gib_s"] > 0 and fig["baseline_gib_s"] > 0 and fig["limit_gib_s"] > 0
    assert "transfer" not in result


def test_a_wrong_fast_path_fails_the_bench(monkeypatch):
    real = ops.gather_blocks

    def off_by_one(pool, slots, out=None, *, impl="torch"):
        return real(pool, [(s + 1) % pool.num_slots for s in slots], out, impl=impl)

    monkeypatch.setattr(ops, "gather_blocks", off_by_one)
    with pytest.raises(AssertionError, match="gather"):
        bench.run(layout="bf16:2x2x2x8", num_slots=16, blocks=6, repeats=1, transfer=False)


def test_cli_json(capsys, monkeypatch):
    import services.drivers.cli

    # main() would point structlog at pytest's captured stderr, which is closed after this test.
    monkeypatch.setattr(services.drivers.cli, "configure_logging", lambda **kw: None)
    rc = main(
        [
            "bench",
            "kv",
            "--json",
            "--layout",
            "fp8_e4m3:2x2x2x8",
            "--slots",
            "8",
            "--blocks",
            "4",
            "--repeats",
            "1",
            "--no-transfer",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "fp8_e4m3:2x2x2x8" and out["block_bytes"] == 64


def test_cli_refuses_more_blocks_than_slots():
    with pytest.raises(ValueError, match="--blocks 9 is more than --slots 8"):
        bench.run(layout="bf16:2x2x2x8", num_slots=8, blocks=9, repeats=1, transfer=False)
