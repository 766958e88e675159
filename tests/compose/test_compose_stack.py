"""deploy/docker-compose.yml run for real (issue 39 part 2; marker ``compose``, not in the default
suite: ``pytest -m compose``): the images of deploy/build-images.sh, the stack brought up with
podman-compose (or docker compose), profiles ``sim``, ``torch`` and ``vllm`` (two vLLM servers on
the CPU, each with our worker attached). Each run:

1. brings up the 3-server NATS cluster and bus-init, then the recorder, directory, planner,
   router, gateway and the engines (and the vLLM servers), and waits until every container's
   healthcheck passes;
2. sends chat requests through the gateway's published port, with an API key from the secrets;
   on a real model (torch, vllm) one asks for a short answer and must stop at the end of the turn
   (finish_reason "stop" within its budget), not run to max_tokens;
3. kills one NATS container (it stays down): requests go on (the stream is R3);
4. crashes an engine (SIGKILL to its process from the host, as a crash would): the restart policy
   brings it back, it registers again and serves again;
5. stops the gateway and the engines, then the recorder (it drains to the head), copies the DuckDB
   log out of its volume and checks that nothing was lost: every request the client sent was
   answered whole and finished in the log, the log's sequence has no hole, and ``evolving
   verify`` reproduces every recorded decision.

Needs podman and podman-compose (bash scripts/install_podman.sh) or docker with its compose plugin
and a daemon; skipped with the reason where no container runtime can run a container. The images
are (re)built first by deploy/build-images.sh: minutes the first time, about a minute after a
source change (the dependency layers are cached). Each phase's duration is printed
(``-s``); docs/deploy.md, "Running the compose stack", has the figures.

Podman 4.3 (Debian 12) starts a container whose ``depends_on`` service has dependencies of its
own with "container ... not found in input list", and cannot wait on ``service_healthy``; the
stack therefore comes up in two steps, as docs/deploy.md tells podman users to: the bus and
bus-init, then (``--no-deps``) the rest, and healthchecks are run with ``podman healthcheck
run`` (they are systemd timers, and this VM has no systemd).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from events.catalog import NodeRegistered, NodeRemoved, RequestFinished, RequestSubmitted
from services.adapters.eventlog import DuckDbEventLog

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
BUS = ("nats-1", "nats-2", "nats-3")
SERVICES = ("recorder", "directory", "planner", "router", "gateway")
ENGINES = {"sim": ("engine-n1", "engine-n2", "engine-n3"), "torch": ("engine-t1", "engine-t2", "engine-t3"),
           "vllm": ("engine-v1", "engine-v2")}
#: containers a profile runs beside its engines: the vLLM servers the workers attach to
SERVERS = {"vllm": ("vllm-v1", "vllm-v2")}
IMAGES = {"sim": "evolving-infra:dev", "torch": "evolving-infra:torch", "vllm": "evolving-infra:vllm"}
#: vLLM on the CPU: each server loads and compiles the model on one thread (1-3 min alone, more on a busy box)
UP_TIMEOUT_S = {"sim": 240, "torch": 480, "vllm": 900}
#: the profiles that serve a real model (the gateway tokenises with it; a turn ends by itself)
MODEL_PROFILES = ("torch", "vllm")


def _sh(args: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command, its output captured; the caller checks the status (and says what failed)."""
    return subprocess.run(args, check=False, capture_output=True, text=True, **kw)


def _log(msg: str) -> None:
    print(f"[compose {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- the runtime
@dataclass
class Runtime:
    """A container engine and its compose front end."""

    engine: str  # podman | docker
    compose: list[str]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([self.engine, *args], check=check, capture_output=True, text=True, timeout=timeout)


def find_runtime() -> tuple[Runtime | None, str]:
    """The runtime that can run a container here, or None and why not."""
    why = []
    podman = shutil.which("podman")
    podman_compose = Path(sys.executable).with_name("podman-compose")
    if podman and podman_compose.exists():
        r = _sh([podman, "info", "--format", "{{.Host.OCIRuntime.Name}}"], timeout=60)
        if r.returncode == 0:
            return Runtime("podman", [str(podman_compose), "--in-pod", "false"]), ""
        why.append(f"podman info failed: {r.stderr.strip()[-300:]}")
    elif podman:
        why.append("podman-compose is not installed in this venv (bash scripts/install_podman.sh)")
    else:
        why.append("no podman (bash scripts/install_podman.sh)")
    docker = shutil.which("docker")
    if docker:
        r = _sh([docker, "compose", "version"], timeout=30)
        d = _sh([docker, "info"], timeout=30)
        if r.returncode == 0 and d.returncode == 0:
            return Runtime("docker", [docker, "compose"]), ""
        why.append("docker has no compose plugin" if r.returncode else "no docker daemon")
    return None, "; ".join(why)


def can_run_a_container(rt: Runtime, work: Path) -> str:
    """'' where ``rt`` runs a container here, else what failed. Probed before any image is built
    (minutes, and a build runs containers too) with a one-binary image imported from a tarball:
    /bin/true and the libraries it links, so no registry and no base image are needed."""
    root = work / "rootfs"
    for d in ("bin", "dev", "proc", "sys", "tmp", "etc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    true = Path(shutil.which("true") or "/bin/true").resolve()
    shutil.copy2(true, root / "bin" / "true")
    ldd = _sh(["ldd", str(true)], timeout=30).stdout
    for lib in {w for w in ldd.split() if w.startswith("/")}:
        dest = root / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(lib).resolve(), dest)
    tar = work / "probe.tar"
    _sh(["tar", "-C", str(root), "-cf", str(tar), "."], timeout=60)
    image = "localhost/evolving-probe:latest"
    r = rt.run("import", str(tar), image, timeout=120, check=False)
    if r.returncode != 0:
        return f"{rt.engine} import failed: {(r.stderr or r.stdout).strip()[-500:]}"
    try:
        r = rt.run("run", "--rm", "--network", "none", image, "/bin/true", timeout=120, check=False)
        return "" if r.returncode == 0 else f"{rt.engine} run failed: {(r.stderr or r.stdout).strip()[-500:]}"
    finally:
        rt.run("rmi", "-f", image, timeout=60, check=False)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Runtime:
    rt, why = find_runtime()
    if rt is None:
        pytest.skip(f"no container runtime can run the stack here: {why}")
    why = can_run_a_container(rt, tmp_path_factory.mktemp("probe"))
    if why:
        pytest.skip(f"{rt.engine} cannot run a container here: {why}")
    return rt


def _build_images(rt: Runtime, profile: str) -> None:
    """deploy/build-images.sh every time: the images hold the source, so an image built before a
    change would test old code; the dependency layers are cached (a source change: about a minute).
    --prune: where the image store lacks the room a build wants, the untagged images go first (a CI
    machine whose store outlives a run filled its disk with the build stages of earlier runs)."""
    # torch / vllm: the engines' (servers') image; the rest runs on :dev
    args = {"torch": ["--torch"], "vllm": ["--vllm"]}.get(profile, []) + ["--prune"]
    r = _sh(["bash", str(DEPLOY / "build-images.sh"), *args], timeout=1800,
            env={**os.environ, "EI_CONTAINER_RUNTIME": rt.engine})
    assert r.returncode == 0, r.stderr[-3000:]


def _probe(rt: Runtime, image: str) -> None:
    """The image just built runs Python as its services' user. The runtime ran a container before the
    build (``can_run_a_container``), so a failure here is the image's: it fails the test, never
    skips it (an image whose /opt/venv/bin was mode 0700 once skipped all three stacks as "podman
    cannot run a container here")."""
    r = rt.run("run", "--rm", image, "python", "-c", "print('ok')", timeout=180, check=False)
    assert r.returncode == 0 and "ok" in r.stdout, \
        f"{image} cannot run python as its user: {(r.stderr or r.stdout).strip()[-500:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the stack
@dataclass
class Stack:
    rt: Runtime
    profile: str
    project: str
    port: int
    env: dict[str, str]
    api_key: str
    timings: dict[str, float] = field(default_factory=dict)
    answered: list[str] = field(default_factory=list)  # the gateway's request ids, every answer

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [*self.rt.compose, "-p", self.project, "-f", str(COMPOSE_FILE), "--profile", self.profile, *args]
        r = _sh(cmd, timeout=timeout, env=self.env, cwd=DEPLOY)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        return r

    def container(self, service: str) -> str:
        r = self.rt.run("ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                        "--filter", f"label=com.docker.compose.service={service}")
        ids = r.stdout.split()
        assert len(ids) == 1, (service, r.stdout, r.stderr)
        return ids[0]

    def inspect(self, service: str, fmt: str) -> str:
        return self.rt.run("inspect", self.container(service), "--format", fmt).stdout.strip()

    def healthy(self, service: str) -> bool:
        cid = self.container(service)
        if self.rt.engine == "podman":  # healthchecks are systemd timers; none run by themselves without systemd
            return self.rt.run("healthcheck", "run", cid, check=False, timeout=60).returncode == 0
        return self.inspect(service, "{{.State.Health.Status}}") == "healthy"

    def wait_healthy(self, services: tuple[str, ...], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        left = list(services)
        while left and time.monotonic() < deadline:
            left = [s for s in left if not self.healthy(s)]
            if left:
                time.sleep(2)
        assert not left, f"not healthy after {timeout_s:.0f} s: {left}\n" + "\n".join(
            f"--- {s}\n{self.logs(s)}" for s in left)

    def logs(self, service: str, tail: int = 15) -> str:
        r = self.rt.run("logs", "--tail", str(tail), self.container(service), check=False)
        return (r.stdout + r.stderr)[-3000:]

    def chat(self, text: str, max_tokens: int = 8) -> dict:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}],
                           "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=180) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # what the router and the gateway said says why
            pytest.fail(f"{text!r}: HTTP {exc.code}: {exc.read()[:2000]!r}\n"
                        + "\n".join(f"--- {s}\n{self.logs(s, 40)}" for s in ("router", "gateway")))
        assert out["choices"][0]["finish_reason"] in ("length", "stop"), out
        assert out["usage"]["completion_tokens"] > 0, out
        self.answered.append(out["evolving"]["request"])
        return out

    def chats(self, n: int, tag: str) -> list[dict]:
        t0 = time.monotonic()

        def timed(i: int) -> float:
            t = time.monotonic()
            self.chat(f"{tag}: request {i} of {n}, say something")
            return time.monotonic() - t

        with ThreadPoolExecutor(3) as pool:
            took = list(pool.map(timed, range(n)))
        self.timings[f"{n} chats ({tag})"] = time.monotonic() - t0
        self.timings[f"the slowest ({tag})"] = max(took)
        return took


def _wait_gateway(stack: Stack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(1)
    pytest.fail(f"the gateway did not answer /health in {timeout_s:.0f} s ({last})\n{stack.logs('gateway')}")


@pytest.fixture(scope="module", params=["sim", "torch", "vllm"])
def stack(request, runtime: Runtime) -> Iterator[Stack]:
    profile = request.param
    t0 = time.monotonic()
    _build_images(runtime, profile)
    st_images = time.monotonic() - t0
    _probe(runtime, IMAGES[profile])
    r = _sh([sys.executable, "-m", "services.drivers.up.compose_secrets"], timeout=60, cwd=ROOT)
    if r.returncode != 0 and "no secrets for" in r.stderr:  # written before a service was added
        r = _sh([sys.executable, "-m", "services.drivers.up.compose_secrets", "--force"], timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "EI_GATEWAY_PORT": str(_free_port())}
    if profile in MODEL_PROFILES:  # the gateway tokenises with the engines' model (docker-compose.yml's header)
        env["EI_TOKENIZER"] = "/opt/models/default.gguf"
    st = Stack(runtime, profile, f"eitest{profile}{os.getpid()}", int(env["EI_GATEWAY_PORT"]), env,
               (DEPLOY / "secrets" / "gateway-api-keys").read_text().split()[0])
    st.timings["images (deploy/build-images.sh)"] = st_images
    st.timings["probe, secrets"] = time.monotonic() - t0 - st_images
    try:
        t1 = time.monotonic()
        st.compose("up", "-d", *BUS, "bus-init")
        assert runtime.run("wait", st.container("bus-init"), timeout=300).stdout.strip() == "0", st.logs("bus-init")
        servers = SERVERS.get(profile, ())
        st.compose("up", "-d", "--no-deps", *servers, *SERVICES, *ENGINES[profile])
        _wait_gateway(st, UP_TIMEOUT_S[profile])
        st.wait_healthy((*BUS, *servers, *SERVICES, *ENGINES[profile]), UP_TIMEOUT_S[profile])
        st.timings["up, all healthy"] = time.monotonic() - t1
        yield st
    finally:
        t2 = time.monotonic()
        _sh([*runtime.compose, "-p", st.project, "-f", str(COMPOSE_FILE), "--profile", profile, "down", "-v",
             "-t", "5"], timeout=300, env=env, cwd=DEPLOY)
        st.timings["down"] = time.monotonic() - t2
        st.timings["total"] = time.monotonic() - t0
        _log(f"{profile}: " + ", ".join(f"{k} {v:.0f} s" for k, v in st.timings.items()))


# ---------------------------------------------------------------------------- the run
def test_requests_survive_a_lost_nats_server_and_a_crashed_engine_and_nothing_is_lost(stack: Stack, tmp_path):
    engines = ENGINES[stack.profile]
    stack.chats(6, "warm")
    if stack.profile in MODEL_PROFILES:  # the model ends its turn: no ignore_eos, the budget is not the end
        t0 = time.monotonic()
        out = stack.chat("Answer with one word: what colour is the sky on a clear day?", max_tokens=200)
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] < 200, out
        stack.timings["a chat that ends its turn"] = time.monotonic() - t0

    # one NATS server killed (it stays down): the R3 stream keeps its quorum, requests go on
    t0 = time.monotonic()
    stack.rt.run("kill", stack.container("nats-2"))  # a killed container is not restarted (a crash is)
    assert stack.inspect("nats-2", "{{.State.Status}}") in ("exited", "stopped")
    stack.chats(6, "nats-2 down")
    assert stack.inspect("nats-2", "{{.State.Status}}") in ("exited", "stopped")  # down all along
    stack.timings["nats-2 killed, 6 chats"] = time.monotonic() - t0

    # an engine crashes (SIGKILL from the host, not a stop): its restart policy brings it back
    t0 = time.monotonic()
    victim = engines[1]
    pid, started = stack.inspect(victim, "{{.State.Pid}} {{.State.StartedAt}}").split(" ", 1)
    os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = stack.inspect(victim, "{{.State.Status}} {{.State.StartedAt}}")
        if state.startswith("running") and state.split(" ", 1)[1] != started:
            break
        time.sleep(1)
    else:
        pytest.fail(f"{victim} did not come back after a crash: {state}\n{stack.logs(victim)}")
    stack.wait_healthy((victim,), UP_TIMEOUT_S[stack.profile])
    stack.timings[f"{victim} crashed until healthy again"] = time.monotonic() - t0
    stack.chats(9, "after the crash")

    # stop what makes events, then the recorder (it records up to the head, then closes the log)
    t0 = time.monotonic()
    for svc in ("gateway", *engines):
        stack.rt.run("stop", "-t", "20", stack.container(svc), timeout=60)
    stack.rt.run("stop", "-t", "60", stack.container("recorder"), timeout=120)
    db = tmp_path / "run.duckdb"
    stack.rt.run("cp", f"{stack.container('recorder')}:/data/run.duckdb", str(db))
    stack.timings["stop, copy the log"] = time.monotonic() - t0

    verify = _sh([sys.executable, "-m", "services.drivers.cli", "verify", str(db)], timeout=600, cwd=ROOT)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]
    assert "every recorded decision was reproduced exactly" in verify.stdout

    with DuckDbEventLog(db, read_only=True) as log:
        rows = list(log.read())
        skipped = log.skipped()
    seqs = [seq for seq, _, _ in rows]
    assert seqs == list(range(1, len(rows) + 1)) and not skipped.ranges, skipped  # no hole in the log
    events = [e for _, _, e in rows]
    submitted = {e.request for e in events if isinstance(e, RequestSubmitted)}
    finished = {e.request for e in events if isinstance(e, RequestFinished)}
    assert len(stack.answered) == 21 + (stack.profile in MODEL_PROFILES) and set(stack.answered) <= submitted  # every answered request is in the log
    assert submitted == finished  # and every request in the log finished
    node = victim.removeprefix("engine-")
    removed = [e for e in events if isinstance(e, NodeRemoved) and e.node == node]
    registered = [e for e in events if isinstance(e, NodeRegistered) and e.node == node]
    assert len(registered) >= 2 and removed, (registered, removed)  # the crashed run removed, the new one registered
