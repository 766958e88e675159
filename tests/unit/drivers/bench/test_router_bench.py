"""`evolving bench router` runs end to end on a small stream (figures are not asserted)."""

from __future__ import annotations

from services.drivers.bench.router import format_report, run
from services.drivers.cli import build_parser


def test_bench_reports_every_router_and_ratio():
    res = run(router="evolving", baselines=("round_robin", "cache_aware"), sizes=(3,), requests=30,
              agents=4, prompt_blocks=50, new_blocks=10, repeats=1)
    entry = res["sizes"]["3"]
    assert set(entry["routers"]) == {"evolving", "round_robin", "cache_aware"}
    assert all(fig["decisions"] == 30 for fig in entry["routers"].values())
    assert set(entry["ratios"]) == {"round_robin", "cache_aware"}
    assert "evolving / cache_aware" in format_report(res)


def test_cli_registers_bench_router():
    args = build_parser().parse_args(["bench", "router", "--json", "--sizes", "9", "--requests", "10"])
    assert args.json and args.sizes == "9" and args.requests == 10 and callable(args.func)
