"""Options are parsed once (docs/architecture.md): the engine worker's command line becomes an
attached backend's typed config in its ``options.py``; the backend modules never see ``args``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.backends.sglang.options import SglangConfig
from engine.backends.sglang.options import config_from_args as sglang_config
from engine.backends.vllm.options import VllmConfig
from engine.backends.vllm.options import config_from_args as vllm_config
from engine.worker.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[3]


def _args(*argv: str):
    return build_parser().parse_args(["--node", "n0", "--nats-url", "nats://127.0.0.1:4222", *argv])


def test_vllm_options_become_its_config(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    cfg = vllm_config(_args("--backend", "vllm", "--vllm-url", "http://h:8000/", "--vllm-pd",
                            "--kv-events-endpoint", "tcp://h:5557, none,tcp://h:5558", "--kv-events-topic", "kv",
                            "--vllm-wait-s", "30", "--metrics-interval-s", "0", "--request-timeout-s", "9"))
    assert cfg == VllmConfig(url="http://h:8000", kv_events_endpoints=["tcp://h:5557", "tcp://h:5558"],
                             kv_events_topic="kv", wait_s=30.0, metrics_interval_s=0.0, request_timeout_s=9.0, pd=True)
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    assert vllm_config(_args("--backend", "vllm", "--vllm-url", "http://h:8000")).api_key == "sk-env"
    assert vllm_config(_args("--backend", "vllm", "--vllm-url", "http://h:8000",
                             "--vllm-api-key", "sk-flag")).api_key == "sk-flag"


@pytest.mark.parametrize(("launch", "url"), [
    ("python -m sglang.launch_server --port 31000 --model m", "http://127.0.0.1:31000"),
    ("python -m sglang.launch_server --port=31001", "http://127.0.0.1:31001"),
    ("python -m sglang.launch_server --model m", "http://127.0.0.1:30000"),  # SGLang's default port
])
def test_sglang_launch_command_names_the_url(launch, url):
    assert sglang_config(_args("--backend", "sglang", "--sglang-launch", launch)).url == url


def test_sglang_options_become_its_config():
    cfg = sglang_config(_args("--backend", "sglang", "--sglang-url", "http://h:30000", "--peer-url", "d1=http://d:1",
                              "--peer-url", "d2=http://e:2", "--decode-log-interval", "8"))
    assert cfg == SglangConfig(url="http://h:30000", peers={"d1": "http://d:1", "d2": "http://e:2"},
                               decode_log_interval=8)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_the_backend_module_never_sees_args(backend):
    tree = ast.parse((ROOT / "engine" / "backends" / backend / "backend.py").read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    params = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    assert "argparse" not in imported and "args" not in names | params
