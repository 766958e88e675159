"""``--served-model-name`` (issue 36 part 1): repeatable on the gateway's command line, and
``evolving up`` passes each one to the gateway it starts (and none when not given)."""

from __future__ import annotations

import argparse

from services.drivers.gateway.__main__ import build_parser
from services.drivers.up.launch import plan_children
from services.drivers.up.options import add_up_args


def _up(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_args(p)
    a = p.parse_args(["--insecure", "--metrics-port", "-1", *argv])
    a.clock_epoch = 0.0
    return a


def test_the_gateway_takes_the_option_repeated():
    assert build_parser().parse_args([]).served_model_name == []
    args = build_parser().parse_args(["--served-model-name", "a", "--served-model-name", "claude-opus-4-8"])
    assert args.served_model_name == ["a", "claude-opus-4-8"]


def test_up_passes_each_name_to_the_gateway(tmp_path):
    children, _ = plan_children(_up("--served-model-name", "a", "--served-model-name", "b"), "nats://x:1",
                                tmp_path, tmp_path / "r.duckdb")
    gw = next(c.cmd for c in children if c.name == "gateway")
    pairs = [gw[i + 1] for i, x in enumerate(gw) if x == "--served-model-name"]
    assert pairs == ["a", "b"]
    children, _ = plan_children(_up(), "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    assert "--served-model-name" not in next(c.cmd for c in children if c.name == "gateway")
