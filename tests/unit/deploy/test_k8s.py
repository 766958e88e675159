"""deploy/k8s: each overlay renders with ``kubectl kustomize`` and every object validates against
the Kubernetes schemas with ``kubernetes-validate`` (strict: an unknown field is an error); the
Secrets of ``python -m services.drivers.up.k8s_secrets`` validate too and are exactly the ones the
pods name; every command parses with its program's own parser; every Python process has probes on
its health endpoints and Prometheus annotations on a port it listens on; the NATS config is the
compose cluster's and passes ``nats-server -t`` with the generated accounts and routes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")  # a requirement of kubernetes-validate
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]' (kubernetes-validate)")

from services.adapters.bus.natsserver import NatsServerError, find_nats_server
from services.drivers.up import k8s_secrets

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("sim", "torch", "gpu")
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="no kubectl on PATH (it renders the kustomizations)")
#: the schemas' version (kubernetes-validate's default is its newest; pinned so a new release of it
#: cannot change what passes)
K8S_VERSION = "1.33"
IMAGE = "evolving-infra"
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def render(path: Path) -> list[dict]:
    r = subprocess.run([KUBECTL, "kustomize", str(path)], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("no kubectl on PATH (it renders the kustomizations)")
    return request.param, render(K8S / "overlays" / request.param)


def validate(doc: dict) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def pod_spec(w: dict) -> dict:
    return w["spec"]["template"]["spec"]


def env_of(docs: list[dict]) -> dict[str, str]:
    [cm] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("evolving-env")]
    return cm["data"]


# ---------------------------------------------------------------------------- schemas
def test_every_object_of_every_overlay_validates_strictly(overlay):
    name, docs = overlay
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "Job", "ConfigMap"} <= kinds
    for doc in docs:
        validate(doc)
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {f"evolving-{name}"}


def test_the_strict_validation_catches_a_misspelt_field(overlay):
    _, docs = overlay
    engine = json.loads(json.dumps(by_kind(docs, "StatefulSet")["engine"]))
    engine["spec"]["template"]["spec"]["containers"][-1]["readinessprobe"] = {"tcpSocket": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, K8S_VERSION, strict=True)


@needs_kubectl
def test_the_root_renders_the_sim_overlay_and_the_cli_validates_it(tmp_path):
    docs = render(K8S)
    assert docs == render(K8S / "overlays" / "sim")
    out = tmp_path / "all.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    cli = Path(shutil.which("kubernetes-validate") or Path(os.sys.executable).parent / "kubernetes-validate")
    r = subprocess.run([str(cli), "--strict", "-k", K8S_VERSION, str(out)], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_generated_secrets_validate():
    for doc in k8s_secrets.build(engines=4, namespace="evolving-gpu")["items"]:
        validate(doc)


# ---------------------------------------------------------------------------- the bus
def test_nats_is_a_3_server_jetstream_cluster_with_a_budget(overlay):
    _, docs = overlay
    nats = by_kind(docs, "StatefulSet")["nats"]
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["podManagementPolicy"] == "Parallel"
    svc = by_kind(docs, "Service")[nats["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert by_kind(docs, "PodDisruptionBudget")["nats"]["spec"]["maxUnavailable"] == 1
    env = env_of(docs)
    assert env["EI_STREAM_REPLICAS"] == "3"
    assert env["EI_NATS_URL"].split(",") == [f"nats://nats-{i}.nats:4222" for i in range(3)]
    mounts = {m["mountPath"]: m for m in pod_spec(nats)["containers"][0]["volumeMounts"]}
    assert {"/etc/nats/nats.conf", "/etc/nats/auth.conf", "/data"} <= set(mounts)


def test_the_nats_config_is_the_compose_one_and_passes_with_the_generated_secrets(tmp_path):
    conf = (K8S / "base" / "nats.conf").read_text()
    assert conf == (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    try:
        nats_server = find_nats_server()
    except NatsServerError as exc:
        pytest.skip(str(exc))
    [auth] = [s for s in k8s_secrets.build()["items"] if s["metadata"]["name"] == "evolving-nats-auth"]
    (tmp_path / "nats.conf").write_text(conf)
    (tmp_path / "auth.conf").write_text(auth["stringData"]["auth.conf"])
    assert "@nats-1.nats:6222" in auth["stringData"]["auth.conf"]
    r = subprocess.run([nats_server, "-c", str(tmp_path / "nats.conf"), "-t"], check=False, capture_output=True,
                       text=True, timeout=30, env={"NATS_SERVER_NAME": "nats-0"})
    assert r.returncode == 0, r.stderr + r.stdout


# ---------------------------------------------------------------------------- secrets
def test_every_pod_reads_a_secret_that_k8s_secrets_writes_and_engines_their_own_key(overlay):
    _, docs = overlay
    engine = by_kind(docs, "StatefulSet")["engine"]
    replicas = engine["spec"]["replicas"]
    generated = {s["metadata"]["name"]: s for s in k8s_secrets.build(engines=replicas)["items"]}
    named = set()
    for w in workloads(docs):
        for v in pod_spec(w).get("volumes", []):
            if "secret" in v:
                named.add(v["secret"]["secretName"])
                assert v["secret"]["secretName"] in generated, f"{w['metadata']['name']}: {v['secret']}"
    assert named == set(generated) - {"evolving-nats-operator"}  # the operator's is for `evolving sql --live`
    keys = set(generated["evolving-nats-engines"]["stringData"])
    assert keys == {f"engine-{i}.json" for i in range(replicas)}
    [worker] = [c for c in pod_spec(engine)["containers"] if c["name"] == "worker"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["EI_NATS_CREDENTIALS_FILE"]["value"] == "/run/secrets/nats/$(POD_NAME).json"


def test_each_engine_account_may_publish_only_as_its_own_node():
    [auth] = [s for s in k8s_secrets.build(engines=2)["items"] if s["metadata"]["name"] == "evolving-nats-auth"]
    text = auth["stringData"]["auth.conf"]
    users = json.loads(re.search(r"users = (\[.*\])", text, re.DOTALL).group(1))
    engine0 = next(u for u in users if u["user"] == "engine-0")
    allowed = engine0["permissions"]["publish"]["allow"]
    assert "ei.default.node.engine-0" in allowed and "ei.default.node.engine-1" not in allowed


# ---------------------------------------------------------------------------- commands
def _parser(args: list[str]):
    """The program's own parser for a container's ``python -m MODULE ...`` and the rest."""
    assert args[:2] == ["python", "-m"], args
    module, rest = args[2], args[3:]
    if module == "services.drivers.serve":
        from services.drivers.serve import build_parser
        return build_parser(rest[0]), rest[1:]
    if module == "engine.worker":
        from engine.worker.__main__ import build_parser
        return build_parser(), rest
    if module == "services.drivers.gateway":
        from services.drivers.gateway.__main__ import build_parser
        return build_parser(), rest
    if module == "services.drivers.up.businit":
        from services.drivers.up.businit import build_parser
        return build_parser(), rest
    raise AssertionError(f"no parser known for {module}")


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` substitution in a container's arguments."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def _run_script(script: str, env: dict[str, str], tmp_path: Path) -> list[str]:
    """What an ``sh -c`` container would exec: a ``python`` on PATH that prints its arguments."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        (shim / name).write_text('#!/bin/sh\nprintf "%s\\0" "$@"\n')
        (shim / name).chmod(0o755)
    r = subprocess.run(["sh", "-c", script], check=True, capture_output=True, text=True, timeout=10,
                       env={**env, "PATH": f"{shim}:/usr/bin:/bin"})
    return r.stdout.split("\0")[:-1]


def _container_env(monkeypatch, env: dict[str, str]) -> None:
    """The process environment a container sees (its EI_* only): parsers read defaults from it."""
    for key in [k for k in os.environ if k.startswith("EI_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_every_command_parses_with_its_programs_parser(overlay, tmp_path, monkeypatch):
    _, docs = overlay
    env = {**env_of(docs), "POD_NAME": "engine-1", "EI_NATS_CREDENTIALS_FILE": "/run/secrets/nats/x.json"}
    _container_env(monkeypatch, env)
    seen = set()
    for w in workloads(docs):
        for c in pod_spec(w)["containers"]:
            if not c["image"].startswith(IMAGE + ":"):
                continue
            args = c["args"]
            if args[:2] == ["sh", "-c"]:
                args = ["python", *_run_script(args[2], env, tmp_path)]
            parser, rest = _parser(_expand(args, env))
            parsed = parser.parse_args(rest)
            seen.add(args[2])
            # every process on the partition's bus: all three servers, the overlay's partition
            assert parsed.nats_url == env["EI_NATS_URL"], w["metadata"]["name"]
            assert parsed.partition == env["EI_PARTITION"], w["metadata"]["name"]
            profile = getattr(parsed, "profile", None)
            if profile:  # a path in the image (/app is the source tree) or a name under deploy/profiles
                path = ROOT / profile.removeprefix("/app/") if profile.startswith("/") else \
                    ROOT / "deploy" / "profiles" / f"{profile}.toml"
                assert path.is_file(), profile
    assert seen == {"services.drivers.serve", "engine.worker", "services.drivers.gateway",
                    "services.drivers.up.businit"}


def test_gpu_engines_start_prefill_then_decode_beside_an_sglang_server_on_their_gpus(tmp_path):
    if KUBECTL is None:
        pytest.skip("no kubectl on PATH (it renders the kustomizations)")
    docs = render(K8S / "overlays" / "gpu")
    env = env_of(docs)
    engine = by_kind(docs, "StatefulSet")["engine"]
    spec = pod_spec(engine)
    assert engine["spec"]["replicas"] == int(env["EI_ENGINES"])
    containers = {c["name"]: c for c in spec["containers"]}
    worker, sglang = containers["worker"], containers["sglang"]
    from engine.worker.__main__ import build_parser
    roles = {}
    for i in range(engine["spec"]["replicas"]):
        pod = {**env, "POD_NAME": f"engine-{i}"}
        args = build_parser().parse_args(_run_script(worker["args"][2], pod, tmp_path)[2:])
        roles[args.node] = args.role
        assert args.backend == "sglang" and args.sglang_url == "http://127.0.0.1:30000"
        assert sorted(args.peer_url) == sorted(f"engine-{j}=http://engine-{j}.engine:30000"
                                              for j in range(engine["spec"]["replicas"]) if j != i)
        server = _run_script(sglang["args"][0], pod, tmp_path)
        assert server[server.index("--disaggregation-mode") + 1] == args.role
    prefill = int(env["EI_PREFILL_NODES"])
    assert [roles[f"engine-{i}"] for i in range(len(roles))] == ["prefill"] * prefill + ["decode"] * (len(roles) - prefill)
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == sglang["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert "nvidia.com/gpu" not in worker["resources"].get("requests", {})
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


# ---------------------------------------------------------------------------- probes, metrics, budgets
def _ports(container: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container.get("ports", [])}


def test_every_long_running_container_has_probes_and_is_scraped(overlay):
    _, docs = overlay
    for w in workloads(docs):
        if w["kind"] == "Job":
            continue
        spec, name = pod_spec(w), w["metadata"]["name"]
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        assert ann.get("prometheus.io/scrape") == "true", name
        listening = {port for c in spec["containers"] for port in _ports(c).values()}
        assert int(ann["prometheus.io/port"]) in listening, name
        for c in spec["containers"]:
            if c["name"] == "metrics":  # the NATS exporter sidecar
                continue
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert probe in c, f"{name}/{c['name']}: no {probe}"
            if c["image"].startswith(IMAGE + ":"):
                ready = c["readinessProbe"]["httpGet"]
                assert ready["path"] in ("/healthz", "/health"), name
                assert _ports(c)[ready["port"]] == int(ann["prometheus.io/port"]), name


def test_budgets_select_existing_pods(overlay):
    _, docs = overlay
    labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)]
    budgets = by_kind(docs, "PodDisruptionBudget")
    assert set(budgets) == {"nats", "engine"}
    for name, pdb in budgets.items():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert sum(all(lab.get(k) == v for k, v in sel.items()) for lab in labels) == 1, name


def test_singletons_never_run_twice(overlay):
    _, docs = overlay
    for name in ("directory", "planner", "router", "gateway"):
        d = by_kind(docs, "Deployment")[name]
        assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"]["type"] == "Recreate", name
    assert by_kind(docs, "StatefulSet")["recorder"]["spec"]["replicas"] == 1
