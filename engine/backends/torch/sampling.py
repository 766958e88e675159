"""How the torch engine picks each output token, and where an output ends (docs/engines.md,
"Sampling and stopping").

Picking (:func:`pick`): a request without sampling parameters, or with ``temperature`` 0 or
``top_k`` 1, is greedy (argmax, ties by the lowest id: :func:`~engine.backends.torch.model.greedy`).
Otherwise the logits are divided by ``temperature``, cut to the ``top_k`` largest (0 or -1: no
cut) and to the smallest set whose probability reaches ``top_p`` (the top token always stays),
and one token is drawn with a ``torch.Generator`` seeded from the request's ``seed`` (or, when
it sent none, its request id) and the token's position in the output (:func:`token_seed`). A
draw depends on nothing else: not on the batch, the node (a prefill node draws the first token,
a decode node the rest) or the device's random state, so the same seed gives the same output.
The draw runs on the CPU in float32, so a CPU and a GPU engine draw alike from equal logits.
A constrained request's row is masked first (the tokens its grammar forbids are -inf:
grammar.py), so greedy and sampled picks alike stay inside the grammar.

Ending (:class:`Stops`): the model's end-of-sequence token ends the output unless the request
(or, when it does not say, the engine's ``--torch-ignore-eos``) ignores it; a ``stop`` string
ends it where it starts in the output's text, and the text sent to the gateway stops before it.
While a stop string may still be completing, the text that could begin it is held back, so a
client never sees a part of a stop string (vLLM does the same).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from engine.backend import Sampling


def token_seed(seed: int | None, request: str, position: int) -> int:
    """The generator seed for output token ``position`` of a request (module docstring)."""
    base = str(seed) if seed is not None else f"request:{request}"
    h = hashlib.blake2b(f"{base}/{position}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


def sample_row(logits: torch.Tensor, sampling: Sampling, seed: int) -> int:
    """One token from one row of logits (module docstring)."""
    x = logits.detach().to("cpu", torch.float32) / max(sampling.temperature, 1e-5)
    if sampling.top_k > 0 and sampling.top_k < x.numel():
        kth = torch.topk(x, sampling.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        vals, idx = torch.sort(x, descending=True)
        probs = torch.softmax(vals, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
        cut = before >= sampling.top_p
        cut[0] = False  # the top token always stays
        x = x.scatter(0, idx[cut], float("-inf"))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen))


def pick(logits: torch.Tensor, rows: Sequence[tuple[str, Sampling | None, int]],
         allowed: Sequence[torch.Tensor | None] | None = None) -> list[int]:
    """The next token of each row of ``logits``; ``rows``: (request, sampling, output position);
    ``allowed``: per row, None or a bool row over the vocabulary (a constraint's mask,
    grammar.py): the other tokens' logits are -inf before the row is picked."""
    if allowed is not None and any(a is not None for a in allowed):
        logits = logits.clone()
        for i, a in enumerate(allowed):
            if a is not None:
                logits[i, : a.numel()].masked_fill_(~a.to(logits.device), float("-inf"))
    out = [int(t) for t in torch.argmax(logits, dim=-1).tolist()]  # greedy.greedy, for every row at once
    for i, (request, sampling, position) in enumerate(rows):
        if sampling is not None and not sampling.greedy:
            out[i] = sample_row(logits[i], sampling, token_seed(sampling.seed, request, position))
    return out


class Stops:
    """Where a request's output ends: its end-of-sequence token, its ``stop`` strings."""

    __slots__ = ("eos", "ignore_eos", "stop")

    def __init__(self, eos: int, ignore_eos: bool, stop: Sequence[str] = ()) -> None:
        self.eos, self.ignore_eos, self.stop = eos, ignore_eos, tuple(s for s in stop if s)

    def at_eos(self, token: int) -> bool:
        return not self.ignore_eos and token == self.eos

    def cut(self, text: str) -> int | None:
        """Where the first stop string begins in ``text`` (None: nowhere)."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def hold(self, text: str) -> int:
        """How much of ``text`` may be sent while more tokens come: all but a tail that could be
        the start of a stop string."""
        keep = len(text)
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = min(keep, len(text) - k)
                    break
        return keep
