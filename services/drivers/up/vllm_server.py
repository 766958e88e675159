"""``python -m services.drivers.up.vllm_server``: one vLLM server in the foreground, as ``evolving up
--engines vllm`` launches each of its own: the same model folder and ``max_model_len``
(services/drivers/up/vllm.py :func:`server_model`), block size (the profile's ``block_tokens``) and
command line (engine/backends/vllm/launch.py: prefix caching, KV events over ZMQ on topic ``kv``,
bfloat16 on the CPU). The process becomes the vLLM server (exec), so a container's stop signal
reaches vLLM itself.

For a container (deploy/docker-compose.yml, profile ``vllm``: ``--host 0.0.0.0``, the worker runs in
another container) or a machine where the servers are started by hand and ``evolving up --engines
vllm --attach URL,...`` serves them. ``--convert-only`` makes the model's Hugging Face folder and
exits: deploy/Dockerfile runs it at build time (``--models-dir /opt/models``), so a container loads
the converted folder at once (the folder's stamp matches its GGUF) and never writes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from engine.backends.vllm.launch import server_command
from engine.profiles import load_profile
from services.drivers.up import models
from services.drivers.up.vllm import server_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.drivers.up.vllm_server", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct's GGUF, as up)")
    p.add_argument("--models-dir", default=None,
                   help="where a .gguf is converted to a Hugging Face folder, once (default: runs/models, as up)")
    p.add_argument("--served-model-name", default=None,
                   help="the name the server serves (default: the model file's name without .gguf, as up)")
    p.add_argument("--profile", default="gb300-glm52",
                   help="engine profile whose block_tokens is vLLM's --block-size (give the workers the same; "
                        "default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default 8192, at most the model's context (as up's --vllm-max-model-len)")
    p.add_argument("--host", default="127.0.0.1", help="where the HTTP API listens (a container: 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-events-port", type=int, default=5557,
                   help="the KV-event publisher's port, bound on every interface (tcp://*:PORT); the worker "
                        "connects to tcp://THIS_HOST:PORT with --kv-events-topic kv")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="OMP_NUM_THREADS of the server (default: every core; up gives each cores / N)")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="VLLM_CPU_KVCACHE_SPACE, whole GiB (default %(default)s, as up)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for vLLM (repeatable), e.g. --vllm-arg=--enforce-eager")
    p.add_argument("--convert-only", action="store_true",
                   help="make the Hugging Face folder, print its path and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "python -m services.drivers.up.vllm_server"
    try:
        src = str(Path(args.model).resolve()) if args.model else models.default_model()
        hf, max_len = server_model(src, args.max_model_len, Path(args.models_dir) if args.models_dir else None)
        block = load_profile(args.profile).block_tokens
    except (ValueError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if args.convert_only:
        print(hf)
        return 0
    served = args.served_model_name or models.served_name(src)
    cmd, env = server_command(str(hf), served, f"http://{args.host}:{args.port}",
                              f"tcp://127.0.0.1:{args.kv_events_port}", block_size=block, max_model_len=max_len,
                              threads=max(1, args.threads), kv_cache_gib=args.kv_cache_gib, extra=args.vllm_arg,
                              host=args.host)
    print(f"{prog}: exec {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 1  # not reached: execve replaces this process


if __name__ == "__main__":
    sys.exit(main())
