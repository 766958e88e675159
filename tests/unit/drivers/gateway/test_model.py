"""The gateway's model tokenizer and chat template (services/drivers/gateway/model.py): a tiny
tokenizer.json folder and a tiny GGUF written here, SmolLM2-135M's real GGUF metadata against the
ids transformers' own GGUF tokenizer gave (recorded), and the errors of a named model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.model_files import smollm2_gguf

tokenizers = pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package (extra: engine)")
pytest.importorskip("jinja2", reason="the optional 'jinja2' package (extra: engine)")

from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers.models import BPE

from services.drivers.gateway.gguf_meta import GgufError, read_metadata
from services.drivers.gateway.model import ModelError, load_model
from services.drivers.gateway.tokenizer import TemplateError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("Ġ", "w"), ("o", "r"), ("l", "d"), ("he", "ll"), ("hell", "o"), ("Ġw", "or"),
          ("Ġwor", "ld")]
SMOLLM2 = smollm2_gguf()
FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "tokenizer"
PROMPTS = ["hello world", "hello, world!\n\nhello  world", "<|im_start|>user\nhi<|im_end|>", "héllo wörld 12"]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: 3 control tokens, the 256 byte symbols, 9 merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIAL + alphabet + ["".join(m) for m in MERGES]
    return tokens, [f"{a} {b}" for a, b in MERGES], [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))


def write_tiny_gguf(path, *, model: str = "gpt2", template: str | None = CHATML) -> None:
    gguf = pytest.importorskip("gguf", reason="the optional 'gguf' package (extra: engine)")
    tokens, merges, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_folder(folder, config: dict | None = None) -> None:
    tokens, _, _ = tiny_vocab()
    tok = tokenizers.Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg if config is None else config))


def test_a_model_folder_gives_its_tokenizer_and_jinja_template(tmp_path):
    write_tiny_folder(tmp_path / "m")
    m = load_model(str(tmp_path / "m"))
    text = m.template.render([{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = m.tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # the markers stay whole
    assert m.tokenizer.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    # a next turn extends this turn's prompt (the gateway's compaction rule)
    turn2 = m.template.render([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
                               {"role": "user", "content": "more"}])
    assert turn2.startswith(text)
    # Anthropic's assistant prefill: the prompt ends inside the last message
    pre = m.template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "wor"}],
                            continue_final=True)
    assert pre == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nwor"


def test_a_lone_tokenizer_json_uses_the_simple_template_and_says_so(tmp_path):
    write_tiny_folder(tmp_path / "m", config={})
    m = load_model(str(tmp_path / "m" / "tokenizer.json"))
    assert "simple template" in m.note
    assert m.template.render([{"role": "user", "content": "hi"}]).endswith("<|assistant|>\n")


def test_a_tiny_gguf_gives_its_bpe_tokenizer_and_template(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    m = load_model(str(path))
    first = len(SPECIAL) + 256
    assert m.tokenizer.encode("hello world") == [first + 6, first + 8]  # "hello", "Ġworld": every merge applied
    assert m.tokenizer.encode("<|im_start|>hello") == [1, first + 6]  # a control token stays whole
    assert m.template.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for text in PROMPTS:
        assert m.tokenizer.decode(m.tokenizer.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


@pytest.fixture(scope="module")
def smollm2():
    return load_model(str(SMOLLM2))


def test_smollm2_ids_match_transformers_own_gguf_tokenizer(smollm2):
    """Our GGUF tokenizer and Jinja template against the ids transformers' AutoTokenizer(gguf_file=)
    and apply_chat_template gave (scripts/record_hf_token_ids.py; loading transformers here would
    cost ~13 s on the loaded 2-core machine)."""
    ref = json.loads((FIXTURES / "smollm2_hf_ids.json").read_text())
    m = smollm2
    for row in ref["texts"]:
        assert m.tokenizer.encode(row["text"]) == row["ids"], row["text"]
    for row in ref["chats"]:
        text = m.template.render(row["messages"])
        assert text == row["text"]
        assert m.tokenizer.encode(text) == row["ids"]


def test_smollm2_real_gguf_metadata_tokenizer_and_template(smollm2):
    m = smollm2
    text = m.template.render([{"role": "user", "content": "Hello world"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n")
    ids = m.tokenizer.encode(text)
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>system\n ... assistant\n
    assert m.bos_id is None  # tokenizer.ggml.add_bos_token is false for SmolLM2
    assert m.tokenizer._tok.get_vocab_size() == 49152 and "49152 tokens" in m.note
    assert m.template.bos_token == "<|im_start|>" and m.template.eos_token == "<|im_end|>"  # ids 1 and 2


def test_named_models_that_cannot_load_are_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ModelError, match="no such file"):
        load_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no tokenizer.json"):
        load_model(str(tmp_path / "empty"))
    write_tiny_gguf(tmp_path / "sp.gguf", model="llama")
    with pytest.raises(ModelError, match="tokenizer.json instead"):
        load_model(str(tmp_path / "sp.gguf"))
    write_tiny_gguf(tmp_path / "bad.gguf", template="{% for m in messages %}")
    with pytest.raises(ModelError, match="does not compile"):
        load_model(str(tmp_path / "bad.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\xff" * 8)
    with pytest.raises(ModelError, match="truncated"):
        load_model(str(tmp_path / "junk.gguf"))
    (tmp_path / "x.bin").write_bytes(b"NOPE" + b"\x00" * 30)
    with pytest.raises(GgufError, match="not a GGUF"):
        read_metadata(tmp_path / "x.bin")
    write_tiny_folder(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the package is absent
    with pytest.raises(ModelError, match="needs the 'tokenizers' package"):
        load_model(str(tmp_path / "m"))


def test_a_template_that_raises_is_a_template_error_naming_messages(tmp_path):
    write_tiny_gguf(tmp_path / "strict.gguf",
                    template="{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    m = load_model(str(tmp_path / "strict.gguf"))
    with pytest.raises(TemplateError, match="system first") as ei:
        m.template.render([{"role": "user", "content": "hi"}])
    assert ei.value.field == "messages"
    with pytest.raises(TemplateError) as ei:
        m.template.render([{"role": "wizard", "content": "hi"}])
    assert ei.value.field == "messages[0].role"
