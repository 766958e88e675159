"""``evolving up --engines vllm[:N]`` and ``--attach``: what it starts and what it refuses, without
vLLM (the launched servers' commands are checked, not run; tests/vllm/ runs them). Each server
gets our block size, max_model_len, prefix caching, KV events on a port of its own bound on every
interface while its worker connects to 127.0.0.1, dev mode (the worker's cache reset) and its
share of the cores; the gateway tokenises with the model's folder and takes the servers' context."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.backends.vllm.fake import FakeVllm
from services.drivers.up import vllm as vllm_up
from services.drivers.up.children import G_SERVER
from services.drivers.up.launch import check_args, plan_children
from services.drivers.up.options import UpSpec, add_up_args, engine_kind, ready_timeout_s, up_spec


def _args(*argv: str) -> UpSpec:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return up_spec(p.parse_args(["--insecure", "--metrics-port", "-1", *argv]), clock_epoch=0.0)


def _problem(spec: UpSpec) -> str | None:
    """Why ``--engines vllm`` cannot run with ``spec`` (None: it can)."""
    return vllm_up.prepare(spec)[0]


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.fixture
def hf(tmp_path):
    d = tmp_path / "tiny-hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096}))
    (d / "tokenizer.json").write_text("{}")  # up checks that it is there; the gateway reads it
    return d


def test_vllm_engines_are_a_kind_of_the_engines_flag():
    a = _args("--engines", "vllm")
    assert (a.engines, engine_kind(a), a.engines_given) == (2, "vllm", False)
    assert (_args("--engines", "vllm:3").engines, _args("--engines", "vllm:3").engines_given) == (3, True)
    assert ready_timeout_s(a) == 900.0


def test_launched_servers_workers_and_gateway(hf, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_up, "vllm_installed", lambda: True)
    problem, a = vllm_up.prepare(_args("--engines", "vllm:2", "--model", str(hf), "--vllm-arg=--enforce-eager"))
    assert problem is None and check_args(a) is None
    assert a.vllm.max_model_len == 4096  # the default 8192, cut to the model's context
    children, urls = plan_children(a, "nats://x:1", tmp_path, tmp_path / "r.duckdb",
                                   credentials={c: tmp_path / f"{c}.json" for c in
                                                ("recorder", "directory", "planner", "router", "gateway",
                                                 "engine-n0", "engine-n1")})
    by = {c.name: c for c in children}
    servers = [by["vllm-n0"], by["vllm-n1"]]
    assert {s.group for s in servers} == {G_SERVER} and not any(s.bus for s in servers)
    for i, s in enumerate(servers):
        cmd, worker = s.cmd, by[f"engine-n{i}"].cmd
        assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--nats-credentials" not in cmd
        assert (_opt(cmd, "--model"), _opt(cmd, "--served-model-name")) == (str(hf), "tiny-hf")
        assert (_opt(cmd, "--block-size"), _opt(cmd, "--max-model-len"), _opt(cmd, "--dtype")) == \
            ("64", "4096", "bfloat16")
        assert "--enable-prefix-caching" in cmd and cmd[-1] == "--enforce-eager"
        events = json.loads(_opt(cmd, "--kv-events-config"))
        port = events["endpoint"].rsplit(":", 1)[1]
        assert events["endpoint"] == f"tcp://*:{port}" and events["publisher"] == "zmq"
        assert (_opt(worker, "--backend"), _opt(worker, "--vllm-url"), _opt(worker, "--prompt-store")) == \
            ("vllm", f"http://127.0.0.1:{_opt(cmd, '--port')}", "on")
        assert _opt(worker, "--kv-events-endpoint") == f"tcp://127.0.0.1:{port}"
        assert _opt(worker, "--kv-events-topic") == events["topic"] and "--nats-credentials" in worker
        assert s.env["VLLM_SERVER_DEV_MODE"] == "1" and int(s.env["OMP_NUM_THREADS"]) >= 1
    assert servers[0].cmd[servers[0].cmd.index("--port") + 1] != servers[1].cmd[servers[1].cmd.index("--port") + 1]
    gw = by["gateway"].cmd
    assert (_opt(gw, "--tokenizer"), _opt(gw, "--model"), _opt(gw, "--context-length")) == (str(hf), "tiny-hf", "4096")
    assert set(urls["vllm"]) == {"n0", "n1"}


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--engines", "vllm", "--prefill", "1"], "needs --vllm-pd"),
    (["--engines", "vllm", "--vllm-max-model-len", "9000"], "want 1..4096"),
    (["--engines", "vllm", "--attach-kv-events", "tcp://127.0.0.1:1"], "goes with --attach"),
    (["--engines", "vllm", "--kv-bytes"], "--kv-bytes"),
])
def test_what_launching_refuses(hf, monkeypatch, argv, fragment):
    monkeypatch.setattr(vllm_up, "vllm_installed", lambda: True)
    assert fragment in _problem(_args(*argv, "--model", str(hf)))


def test_pd_servers_share_a_kv_connector_store(hf, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_up, "vllm_installed", lambda: True)
    problem, a = vllm_up.prepare(_args("--engines", "vllm:2", "--model", str(hf), "--vllm-pd", "--prefill", "1"))
    assert problem is None and check_args(a) is None
    children, _ = plan_children(a, "nats://x:1", tmp_path, tmp_path / "r.duckdb")
    by = {c.name: c.cmd for c in children}
    stores = set()
    for i in range(2):
        kv = json.loads(_opt(by[f"vllm-n{i}"], "--kv-transfer-config"))
        assert (kv["kv_connector"], kv["kv_role"]) == ("ExampleConnector", "kv_both")
        stores.add(kv["kv_connector_extra_config"]["shared_storage_path"])
        assert "--vllm-pd" in by[f"engine-n{i}"]
    assert stores == {str(tmp_path / "vllm-kv")}
    assert (_opt(by["engine-n0"], "--role"), _opt(by["engine-n1"], "--role")) == ("prefill", "decode")
    assert "--planner-arg=warmup_s=5" in by["planner"]  # roles switch in place: the planner decides within seconds


def test_without_vllm_installed_it_says_how_to_install(hf, monkeypatch):
    monkeypatch.setattr(vllm_up, "vllm_installed", lambda: False)
    assert "bash scripts/setup.sh --vllm" in _problem(_args("--engines", "vllm", "--model", str(hf)))


def test_attach_needs_the_vllm_kind():
    assert "--engines vllm" in check_args(_args("--engines", "2", "--attach", "http://127.0.0.1:1"))


async def test_attach_plans_from_the_servers_own_answers(hf, tmp_path):
    """--attach asks each server its model and max_model_len; no server is launched."""
    fakes = [FakeVllm(model="m", max_model_len=3000), FakeVllm(model="m", max_model_len=2000)]
    urls = [await f.start() for f in fakes]
    try:
        def prep(*argv):
            return _problem(_args("--engines", "vllm", "--attach", ",".join(urls), *argv))

        a = _args("--engines", "vllm", "--attach", ",".join(urls), "--attach-kv-events",
                  "tcp://127.0.0.1:7001,tcp://127.0.0.1:7002", "--model", str(hf))
        problem, a = await _in_thread(vllm_up.prepare, a)
        assert problem is None and check_args(a) is None
        assert a.engines == 2 and engine_kind(a) == "vllm" and not a.vllm.launch
        assert (a.vllm.served, a.vllm.max_model_len) == ("m", 2000)
        children, _ = plan_children(a, "nats://x:1", tmp_path, tmp_path / "r.duckdb")
        names = [c.name for c in children]
        assert "vllm-n0" not in names and {"engine-n0", "engine-n1"} <= set(names)
        w1 = next(c.cmd for c in children if c.name == "engine-n1")
        assert (_opt(w1, "--vllm-url"), _opt(w1, "--kv-events-endpoint")) == (urls[1], "tcp://127.0.0.1:7002")
        assert "no vLLM server answers" in await _in_thread(
            _problem, _args("--engines", "vllm", "--attach", "http://127.0.0.1:9"))
        assert "binds" in await _in_thread(prep, "--model", str(hf), "--attach-kv-events", "tcp://*:1,tcp://*:2")
        assert "names 2 server(s)" in await _in_thread(
            _problem, _args("--engines", "vllm:3", "--attach", ",".join(urls), "--model", str(hf)))
        assert "give --model" in await _in_thread(prep)  # the fake's root is no folder here
    finally:
        for f in fakes:
            await f.stop()


async def _in_thread(fn, *args):
    import asyncio

    return await asyncio.to_thread(fn, *args)
