"""A Hugging Face model folder from a GGUF checkpoint, for engines that read only that layout
(vLLM: ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``).

The weights come from the torch backend's loader (engine/backends/torch/loader.py: quantised
tensors dequantised, Q/K rows un-permuted back to the Hugging Face layout) and are written in
bfloat16; the tokenizer is the one the gateway builds from the same GGUF metadata
(services/drivers/gateway/model.py :func:`gguf_tokenizer`), so the engine and the gateway
tokenise alike; the chat template and the special tokens go to ``tokenizer_config.json``.

The folder is made once per source file: ``<cache>/<stem>-hf`` holds a ``source.json`` naming
the GGUF file's path, size and modification time, and a folder whose stamp matches is reused.
A half-written folder has no stamp (it is written last) and is made again.

Here, beside the gateway's GGUF tokenizer it uses, rather than in services/drivers/up/: ``evolving
up``, ``evolving bench engine`` (its vLLM column) and ``evolving chaos --engines vllm`` all
convert, and ``up`` imports the bench package, so a converter under ``up`` made a circle of
folders (scripts/structure.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

#: where converted folders are kept unless told otherwise (``runs/`` is not versioned)
DEFAULT_CACHE = Path(__file__).resolve().parents[3] / "runs" / "models"


def _stamp(src: Path) -> dict:
    st = src.stat()
    return {"source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": 1}


def hf_folder(model: str, cache: Path | None = None) -> Path:
    """``model`` as a Hugging Face folder: a folder with ``config.json`` as it is, a ``.gguf`` file
    converted (once) into ``cache``. Raises ValueError naming the path for anything else."""
    src = Path(model)
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise ValueError(f"--model {model}: the folder has no config.json")
        return src
    if not (src.is_file() and src.suffix == ".gguf"):
        raise ValueError(f"--model {model}: want a .gguf file or a Hugging Face folder (config.json, "
                         "*.safetensors, tokenizer.json)")
    out = (cache or DEFAULT_CACHE) / f"{src.stem}-hf"
    stamp = out / "source.json"
    want = _stamp(src)
    try:
        if json.loads(stamp.read_text()) == want:
            return out
    except (OSError, ValueError):
        pass
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    export_gguf(src, tmp)
    (tmp / "source.json").write_text(json.dumps(want))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def export_gguf(src: Path, out: Path) -> None:
    """Write ``out`` (the module docstring) from the GGUF file ``src``."""
    import torch  # lazy: the torch engine's dependency, only when a model is converted

    from engine.backends.torch.loader import load, write_safetensors  # lazy: torch, as above

    ck = load(str(src))
    write_safetensors(out, ck.cfg, {k: v.to(torch.bfloat16) for k, v in ck.weights.items()})
    config = json.loads((out / "config.json").read_text())
    config.update(torch_dtype="bfloat16", max_position_embeddings=ck.cfg.max_pos)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    export_tokenizer(src, out, ck.cfg.max_pos)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": ck.cfg.bos, "eos_token_id": ck.cfg.eos}))


def export_tokenizer(src: Path, out: Path, model_max_length: int | None = None) -> Path:
    """The tokenizer of the GGUF file ``src`` as a Hugging Face tokenizer folder ``out``
    (``tokenizer.json``: the gateway's own build, :func:`gguf_tokenizer`; ``tokenizer_config.json``:
    the special tokens and the chat template), which transformers' ``AutoTokenizer`` loads
    offline: what a client such as aiperf (``--tokenizer DIR``) counts tokens with, alike the
    gateway's ``--tokenizer auto``. ``model_max_length``: the file's context length unless given
    (the sim stack serves longer prompts than SmolLM2's 8,192). No torch needed."""
    from services.drivers.gateway.gguf_meta import read_metadata  # lazy: only when converting
    from services.drivers.gateway.model import gguf_tokenizer  # lazy: tokenizers, only when converting

    meta = read_metadata(src)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    out.mkdir(parents=True, exist_ok=True)
    gguf_tokenizer(meta, str(src)).save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    if model_max_length is None:
        model_max_length = meta.get(f"{meta.get('general.architecture')}.context_length")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"), "eos_token": token("eos"),
               "unk_token": token("unknown"), "pad_token": token("padding"),
               "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
               "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok_cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok_cfg.items() if v is not None},
                                                          indent=1))
    return out
