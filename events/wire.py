"""Wire types shared by the engines and the gateway that are not control-plane events.

Generated tokens are not facts the control plane folds (``FirstToken`` / ``RequestFinished``
are), so they travel on core NATS (no JetStream storage, at-most-once) on the subject

    ``eitok.<partition>.<key>``   with ``key = token_key(request)``

``token_key`` is the first 16 hex digits of BLAKE2b(request id), so any request id (slashes,
dots, spaces) maps to one safe subject token. Outside ``ei.<p>.>`` on purpose: the partition's
stream never stores these messages.

Each message is one JSON-encoded :class:`TokenMsg` (readable with ``nats sub 'eitok.>'``):

- ``kind="first"``: the first output token exists (prefill done), ``tokens=1``;
  ``cached_tokens``: the prompt tokens whose KV the engine reused (its ``RequestStarted``),
  absent when the engine does not say (the gateway then uses the router's plan, ``t_c``).
- ``kind="chunk"``: ``tokens`` more tokens, ``total`` generated so far, ``text`` their text.
- ``kind="done"``: generation finished, ``total`` output tokens, ``finish_reason``.
- ``kind="error"``: the request failed on the engine, ``error`` says why.

The sim engine generates no model output: its ``text`` cycles the words of :data:`SIM_WORDS`, one
word per token (:func:`sim_text`). Each word is a whole English word with a leading space, one
token in byte-level BPE vocabularies (SmolLM2's, the default stack's tokenizer; GPT-2's, Llama 3's
and Qwen 2's split words the same way): their pre-tokenizer cuts the text before every
space-led word, so no merge crosses two of them and a client that re-tokenises the text counts
the tokens the engine reported (tests/unit/drivers/gateway/test_sim_text.py checks it with the
bundled model's tokenizer).

Bottom layer: msgspec and the standard library only. The NATS adapter that publishes and
subscribes these messages is ``services.adapters.bus.tokens.NatsTokens``.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from events.subjects import token

#: the sim engine's output, one word per token, cycled from token 0 of each request (module docstring)
SIM_WORDS = (" this", " is", " a", " simulated", " answer", " and", " not", " the", " output", " of", " a",
             " model")
_ENC = msgspec.json.Encoder()


class TokenMsg(msgspec.Struct, frozen=True, kw_only=True):
    request: str
    kind: Literal["first", "chunk", "done", "error"]
    tokens: int = 0  # new tokens in this message
    total: int = 0  # tokens generated so far (including these)
    text: str = ""  # text of the new tokens
    node: str = ""
    ts: float = 0.0
    finish_reason: str = ""
    error: str = ""
    simulated: bool = False  # the text is the sim engine's (SIM_WORDS), not a model's
    # "first" only: prompt tokens the engine found cached (engine/worker/loop.py fills it in from the
    # node's RequestStarted); UNSET (absent from the JSON) when unknown.
    cached_tokens: int | msgspec.UnsetType = msgspec.UNSET


_DEC = msgspec.json.Decoder(TokenMsg)


def sim_text(n: int, start: int = 0) -> str:
    """The sim engine's text for its output tokens ``start`` to ``start + n``: the words of
    :data:`SIM_WORDS` from position ``start``, so a request's chunks join into the same text
    however its tokens were split between messages."""
    k = len(SIM_WORDS)
    return "".join(SIM_WORDS[(start + i) % k] for i in range(max(0, n)))


def token_key(request: str) -> str:
    return hashlib.blake2b(request.encode(), digest_size=8).hexdigest()


def token_subject(partition: str, request: str) -> str:
    return f"eitok.{token(partition)}.{token_key(request)}"


def encode(msg: TokenMsg) -> bytes:
    return _ENC.encode(msg)


def decode(data: bytes) -> TokenMsg:
    return _DEC.decode(data)
