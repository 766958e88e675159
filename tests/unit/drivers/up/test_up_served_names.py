"""``--served-model-name``: repeatable on the gateway's command line, and
``evolving up`` passes each one to the gateway it starts (and none when not given); so it does
``--tool-call-parser`` (the gateway's own default, ``auto``, when not given), also to the one
gateway of a partitioned run."""

from __future__ import annotations

import argparse

from services.drivers.gateway.__main__ import build_parser
from services.drivers.up.launch import plan_children
from services.drivers.up.options import UpSpec, add_up_args, up_spec


def _up(*argv: str) -> UpSpec:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return up_spec(p.parse_args(["--insecure", "--metrics-port", "-1", *argv]), clock_epoch=0.0)


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


def _gateway(args: argparse.Namespace, tmp_path) -> list[str]:
    children, _ = plan_children(args, "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    return next(c.cmd for c in children if c.name == "gateway")


def test_up_passes_the_tool_call_parser_to_the_gateway(tmp_path):
    gw = _gateway(_up("--tool-call-parser", "hermes"), tmp_path)
    assert gw[gw.index("--tool-call-parser") + 1] == "hermes"
    # parsed by the gateway's own parser, as up starts it
    assert build_parser().parse_args(gw[gw.index("--host"):]).tool_call_parser == "hermes"
    assert "--tool-call-parser" not in _gateway(_up(), tmp_path)
    assert build_parser().parse_args([]).tool_call_parser == "auto"


def test_an_unknown_parser_is_refused_by_up(capsys):
    p = argparse.ArgumentParser()
    add_up_args(p)
    try:
        p.parse_args(["--tool-call-parser", "qwen_xml"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("accepted an unknown parser")
    assert "invalid choice: 'qwen_xml'" in capsys.readouterr().err


def test_the_gateway_of_a_partitioned_run_gets_the_options_too(tmp_path):
    gw = _gateway(_up("--partitions", "2", "--engines", "2", "--tool-call-parser", "mistral",
                      "--served-model-name", "a"), tmp_path)
    assert "--partitions" in gw
    assert gw[gw.index("--tool-call-parser") + 1] == "mistral"
    assert gw[gw.index("--served-model-name") + 1] == "a"
