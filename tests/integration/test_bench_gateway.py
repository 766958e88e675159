"""``evolving bench gateway`` end to end, tiny: both paths serve every request (a nats-server,
two sim engine processes, the router and gateway processes), and every full-path request is
split into its parts (no timing is checked)."""

from __future__ import annotations

import argparse
import asyncio

from services.drivers.bench.gateway import GatewayBenchSpec, add_arguments, run


def test_both_paths_serve_every_request_and_each_one_is_split():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--concurrency", "2", "--requests", "4", "--rounds", "1", "--warmup", "1",
                         "--prompt-tokens", "200", "--turns", "2"])
    r = asyncio.run(run(GatewayBenchSpec(**vars(args))))
    assert r["n_errors"] == 0, r["errors"]
    (row,) = r["rows"]
    assert row["engine_alone_ttft_ms"]["n"] == row["full_path_ttft_ms"]["n"] == 4
    assert row["paired_overhead_ms"]["n"] == 4 and all(v["n"] == 4 for v in row["split_ms"].values())
    assert row["paired_overhead_ms"]["p50"] > 0 and row["gateway_cpu_ms_per_request"] > 0
