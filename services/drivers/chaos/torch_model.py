"""``evolving chaos --engines torch``: the reference engine (engine/backends/torch) in the suite.

Each node's worker is ``python -m engine.worker --backend torch`` on one checkpoint: ``--model
PATH``, or a tiny random Llama (2 layers, hidden 64, 512 ids, 8192 positions: the gateway row's
3,000-token stream fits) that :func:`write_tiny_checkpoint` writes into the work directory as a
GGUF file, so a run needs no download. What the workers are given and why:

- ``--prompt-store off``: the load generator publishes requests on the bus, not through a
  gateway, so no prompt has token ids in the store; the engine makes its ids from the request's
  block hashes (engine/backends/torch/backend.py ``_ids``), which is what a store miss falls back
  to anyway, without a read per request;
- ``--torch-ignore-eos``: a random model may end a request at its first token; the load's
  ``max_tokens`` (and the gateway row's long stream) stay what the harness asked;
- small KV pools (``--torch-l1-blocks`` / ``--torch-l2-blocks``): the profile's capacities would
  allocate (and zero) 1.5 GiB per worker;
- one torch thread per worker (``TORCH_ENV``): four workers share the machine's cores with the
  services; intra-op threads only spin there.

KV moves between the workers with Mooncake over TCP when it imports (the torch engine's own
transfers, checksum-verified: a cut transfer is refused and recomputed), else not at all (the
decode node recomputes the prompt; ``torch_no_transfer`` in the worker's log).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: the tiny checkpoint's shape (engine/backends/torch/model.py ``LlamaConfig``)
TINY = {"vocab": 512, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "max_pos": 8192}
#: 128 + 256 MiB of KV per worker at the tiny model's 32 KiB a block (a decode node with 2,048 L1 blocks
#: ran out of room for its pulls under the suite's load and recomputed the prompts instead)
L1_BLOCKS, L2_BLOCKS = 4096, 8192
TORCH_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def torch_missing() -> str:
    """Why ``--engines torch`` cannot run here (one line), "" when it can."""
    missing = [m for m in ("torch", "gguf") if importlib.util.find_spec(m) is None]
    return f"--engines torch needs {' and '.join(missing)} (pip install -e '.[engine]')" if missing else ""


def write_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random tiny Llama as a GGUF file at ``path`` (kept when it exists: a re-run reuses it)."""
    if path.exists():
        return path
    from engine.backends.torch import loader  # lazy: optional dependency (torch, gguf)
    from engine.backends.torch.model import LlamaConfig  # lazy: optional dependency (torch)

    cfg = LlamaConfig(**TINY)
    tmp = path.with_suffix(".partial")
    loader.write_gguf(tmp, cfg, loader.random_weights(cfg, seed))
    tmp.replace(path)
    return path


def torch_worker_args(model: str | None) -> list[str]:
    """The ``engine.worker`` options of a torch worker in the suite (module docstring)."""
    args = ["--backend", "torch", "--prompt-store", "off", "--torch-ignore-eos",
            "--torch-l1-blocks", str(L1_BLOCKS), "--torch-l2-blocks", str(L2_BLOCKS), "--transfer-host", "127.0.0.1"]
    if model:
        args += ["--model", str(model)]
    return args
