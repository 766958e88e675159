"""How long the sim engine's answer is: it ends its turn like a model, not at ``max_tokens``.

A live sim node (``SimBackend``) generates, for each request, an output length drawn from a
distribution of real output lengths, capped by the request's ``max_tokens``, and then ends the
turn (``finish_reason`` ``"stop"``, Anthropic's ``end_turn``); only a draw that reaches the
budget ends with ``"length"``. So a client that asks ``max_tokens`` 64,000 (Claude Code) or
leaves it to the server (Codex) gets an answer of a few hundred tokens and finishes its turn.

The length, in order of precedence (:func:`sim_output_tokens`):
1. ``ignore_eos`` true in the request (vLLM's and SGLang's name; benchmarks, trace replays
   through the gateway), or not said at all (``RequestSubmitted.ignore_eos`` absent: a trace
   driver or a bench publishing on the bus, whose ``max_tokens`` is the recorded length, and
   every log written before the field): exactly ``max_tokens``, as every sim run did before.
2. ``ignore_eos`` false (the gateway sets it on every request that does not ask otherwise) and
   ``nvext.agent_hints.osl`` (the harness's expected output length): that, capped by ``max_tokens``.
3. else a draw from the profile's ``[output]`` quantiles, or :data:`DEFAULT_OUTPUT_TOKENS`, capped.

The draw is deterministic: ``u`` comes from BLAKE2b of the request id (:func:`unit`), never from
global random state, so every node that computes a request's length (its prefill node and its
decode node, in two processes) gets the same one, and a rerun of the same requests the same.

:data:`DEFAULT_OUTPUT_TOKENS` is fitted on the 34 real Claude Code sessions bundled in
``deploy/traces/calibration`` (2,610 requests, main and sub-agent): the sample quantiles at
:data:`PROBS` of every request's recorded output tokens (:func:`fit_output_tokens`; the test
tests/unit/engine/test_sim_lengths.py refits it from the files and checks these numbers).
Median 212 tokens, p90 899, p99 3,883, max 15,390. The trace simulator (``replay/sim``) draws
nothing: a trace's recorded output length is its ``max_tokens`` and its requests run to it,
and the CC-like generator's output distribution (``replay/traces/cc_params.json``) is fitted on
the same sessions (the bundled files are every third of its 100; output tokens KS 0.019), so a
live sim run and a simulated one produce answers of the same lengths.

Layer 2 (adapter, with the sim engine). May import: stdlib, numpy, ``replay.traces.workloads``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from replay.traces.workloads import Quantiles

#: the probabilities of the fitted quantiles (denser in the tails, where the lengths spread)
PROBS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

#: output tokens of real Claude Code requests (module docstring), at :data:`PROBS`
DEFAULT_OUTPUT_TOKENS = Quantiles(q=(0, 50, 92, 105, 128, 151, 176, 212, 268, 351, 509, 899, 1490, 3883, 15390),
                                  p=PROBS, integer=True)


def fit_output_tokens(values: Sequence[float]) -> Quantiles:
    """The quantile function of recorded output lengths at :data:`PROBS` (rounded to tokens)."""
    if len(values) < 2:
        raise ValueError("an output-length fit needs at least two values")
    q = np.quantile(np.asarray(values, dtype=float), PROBS)
    return Quantiles(q=tuple(float(round(v)) for v in q), p=PROBS, integer=True)


def unit(request: str) -> float:
    """A number in (0, 1) that only the request id decides (BLAKE2b, 64 bits)."""
    h = int.from_bytes(hashlib.blake2b(request.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return (h + 0.5) / 2.0**64


def sim_output_tokens(request: str, max_tokens: int, *, osl: int = 0, ignore_eos: bool | None = False,
                      dist: Quantiles = DEFAULT_OUTPUT_TOKENS) -> int:
    """The output length of ``request`` on a sim node (module docstring), at least 1 token and
    at most ``max(1, max_tokens)``; ``ignore_eos`` None (not said) runs to the budget."""
    budget = max(1, max_tokens)
    if ignore_eos is not False:
        return budget
    want = osl if osl > 0 else int(dist.at(unit(request)))
    return max(1, min(budget, want))
