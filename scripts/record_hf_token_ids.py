"""Record the token ids transformers' own tokenizer gives for SmolLM2-135M-Instruct's GGUF
(``AutoTokenizer.from_pretrained(folder, gguf_file=...)``: the tokenizer rebuilt from the file's
metadata, and ``apply_chat_template`` with its ``tokenizer.chat_template``) into
``tests/fixtures/tokenizer/smollm2_hf_ids.json``.

``tests/unit/drivers/gateway/test_model.py`` checks the gateway's own GGUF tokenizer and Jinja
template (services/drivers/gateway/model.py) against these ids, so the test does not load
transformers (~13 s on the loaded 2-core machine). Needs ``transformers`` (extra: bench-engine).

    .venv/bin/python scripts/record_hf_token_ids.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoTokenizer, __version__

from engine.model_files import smollm2_gguf

TEXTS = [
    "Hello world",
    "Hello world 12345 + 678 = 13023",
    "  leading spaces and trailing   ",
    "code:\n\tdef f(x):\n\t\treturn x**2  # comment\n",
    "Ünïcödé 日本語 emoji 🎉🎉 and \u00a0nbsp",
    "<|im_start|>user\nhey<|im_end|>\n<|endoftext|>",
    "don't they'll we've I'm it's",
    "\n\n\nnewlines\r\nand tabs\t\t",
]
CHATS = [
    [{"role": "user", "content": "Hello world"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? Answer in 日本語."}],
]


def _dump(out: dict) -> str:
    """One line per text or chat (ids lists stay on one line)."""
    lines = ["{", f' "source": {json.dumps(out["source"])},']
    for key in ("texts", "chats"):
        rows = [f"  {json.dumps(r, ensure_ascii=False)}" for r in out[key]]
        lines += [f' "{key}": [', ",\n".join(rows), " ]" + ("," if key == "texts" else "")]
    return "\n".join([*lines, "}"]) + "\n"


def main() -> None:
    path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(os.fspath(path.parent), gguf_file=path.name)
    out = {"source": f"transformers {__version__} AutoTokenizer(gguf_file={path.name})",
           "texts": [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TEXTS],
           "chats": [{"messages": m,
                      "text": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                      "ids": list(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True)["input_ids"])}
                     for m in CHATS]}
    dest = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tokenizer" / "smollm2_hf_ids.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(_dump(out))
    print(f"wrote {dest}: {len(TEXTS)} texts, {len(CHATS)} chats")


if __name__ == "__main__":
    main()
