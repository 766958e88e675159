"""Structured output in the torch engine: a request's ``OutputConstraint`` enforced by a token mask
at every step, with llguidance (docs/engines.md, "Structured output").

Compiling (:class:`Grammars`): a constraint becomes one llguidance Lark grammar,
``start: PREFIX %json{SCHEMA} SUFFIX`` (engine/structured.py, torch-free so the gateway checks
schemas with it), its JSON written with fixed whitespace
(``whitespace_flexible`` false, separators ``", "`` and ``": "``), so a model cannot spend its
budget on blanks and the text is what a JSON encoder writes. The llguidance tokenizer is built
once per checkpoint from its ``tokenizers`` JSON (~0.3 s for SmolLM2); a constraint is compiled
once per distinct constraint (cached by a BLAKE2b of its three fields) into a pristine matcher
that each request deep-copies.

Per step (:class:`Guide`): before a constrained row is picked, its matcher consumes the output
tokens it has not seen (a decode node that pulled a request prefilled elsewhere catches up on
the prefill node's first token the same way) and gives the bitmask of the tokens the grammar
allows next; the engine sets every other logit to -inf and picks as it would (greedy or
sampled: engine/backends/torch/sampling.py). End-of-sequence is allowed only where the grammar
accepts, begin-of-sequence never (a GGUF vocabulary's control tokens are plain text to its BPE
tokenizer, and the engine drops them from the text by id). The output ends, finish ``stop``,
when the grammar is complete: the matcher is stopped (nothing may follow), or the model picked
EOS where the grammar accepts. A budget that runs out first ends it with ``length`` (an
incomplete value, as any engine's).

A constraint that does not compile is a :class:`GrammarError`: the engine fails that request
(the gateway checks schemas with the same compiler first, so only a publisher that bypasses it
gets there), never the node.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.structured import JSON_OPTIONS, GrammarError, key, lark, validate
from events.catalog import OutputConstraint
from services.adapters.logging import get_logger

__all__ = ["JSON_OPTIONS", "GrammarError", "Grammars", "Guide", "key", "lark", "validate"]

log = get_logger("torch_grammar")

class Guide:
    """One request's matcher (module docstring): ``allowed()`` before each pick, ``complete()``
    after it."""

    __slots__ = ("_m", "bos", "consumed", "eos", "vocab")

    def __init__(self, matcher, vocab: int, eos: int, bos: int | None) -> None:
        self._m, self.vocab, self.eos, self.bos = matcher, vocab, eos, bos
        self.consumed = 0  # output tokens the matcher has seen

    def catch_up(self, out: list[int]) -> None:
        """Feed the matcher the output tokens it has not seen (EOS is the end, not text)."""
        new = [t for t in out[self.consumed:] if t != self.eos]
        self.consumed = len(out)
        if new and not self._m.consume_tokens(new):
            log.error("torch_grammar_rejected", error=self._m.get_error(), tokens=new[:8])

    def allowed(self, out: list[int]) -> torch.Tensor:
        """A bool row over the vocabulary: the tokens the grammar allows after ``out``. A matcher
        in error (a token it never allowed: not reachable through this mask) allows only EOS,
        so the output ends at once."""
        self.catch_up(out)
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        if self._m.is_error():
            mask[self.eos] = True
            return mask
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = min(self.vocab, bits.size)
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if self.bos is not None and self.bos != self.eos:
            mask[self.bos] = False
        mask[self.eos] = self._m.is_accepting()
        if not bool(mask.any()):  # the grammar allows nothing the model can write: end here
            mask[self.eos] = True
        return mask

    def complete(self, out: list[int]) -> bool:
        """Whether the output ends with its last token: EOS where the grammar accepts (the mask
        allows it nowhere else), or a grammar that allows nothing more."""
        if not out:
            return False
        if out[-1] == self.eos:
            return True
        self.catch_up(out)
        return self._m.is_stopped() or self._m.is_error()


class Grammars:
    """The compiled constraints of one checkpoint's tokenizer (module docstring)."""

    def __init__(self, tokenizer, vocab: int, eos: int, bos: int | None = None, cache_size: int = 256) -> None:
        self._tokenizer_src, self.vocab, self.eos, self.bos = tokenizer, vocab, eos, bos
        self._lltok = None
        self._cache: dict[str, object] = {}  # key -> pristine matcher, insertion order = age
        self.cache_size = cache_size
        self.compiled = 0  # constraints compiled (cache misses)

    def _tokenizer(self):
        if self._lltok is None:
            try:
                import llguidance  # lazy: the engine's optional dependency
            except ModuleNotFoundError:
                raise GrammarError("structured output needs llguidance (pip install 'evolving-infra[engine]')") from None
            if self._tokenizer_src is None:
                raise GrammarError("structured output needs the model's tokenizer (this checkpoint has none)")
            self._lltok = llguidance.LLTokenizer(self._tokenizer_src.to_str(), n_vocab=self.vocab, eos_token=self.eos)
        return self._lltok

    def guide(self, c: OutputConstraint) -> Guide:
        """A fresh :class:`Guide` for one request; :class:`GrammarError` if ``c`` does not compile."""
        k = key(c)
        pristine = self._cache.get(k)
        if pristine is None:
            import llguidance  # lazy: the engine's optional dependency (absent: _tokenizer said so first)

            tok = self._tokenizer()
            pristine = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(lark(c)), log_level=0)
            if pristine.is_error():
                raise GrammarError(f"constraint does not compile: {pristine.get_error()}")
            self.compiled += 1
            self._cache[k] = pristine
            while len(self._cache) > self.cache_size:
                self._cache.pop(next(iter(self._cache)))
        return Guide(pristine.deep_copy(), self.vocab, self.eos, self.bos)
