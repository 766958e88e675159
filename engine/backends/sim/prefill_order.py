"""The order a simulated prefill node serves its queue in: no head-of-line
blocking behind long prefills. Pure helpers for ``SimNode`` (node.py).

Two orders, chosen per run (the stack's ``prefill_order``):

- ``fcfs``: what SGLang and vLLM do by default. Agent-hint priority first, then arrival; the
  running chunked prefill takes the token budget first, so every request that arrives behind a
  300K-token cold prompt waits for its whole prefill (tens of seconds at the pressure profile:
  a 16K chunk at 300K context is a 6.3 s iteration).
- ``short_first``: the shortest expected remaining prefill first, with aging, in time-bounded
  iterations:

  1. order: agent-hint priority first, then ``remaining_s - AGING * waited_s`` (expected
     remaining prefill time, eq. 1 at the request's context, less the time it has waited since
     it was enqueued), then arrival, then request id. Every second a long prefill waits moves
     it ahead by one second of service: a request that needs ``S`` s of prefill goes ahead of
     any newly arrived one at the latest once it has waited ``S`` s;
  2. time bound: an iteration takes chunks while its predicted time (eq. 1 without restore,
     noise left out) stays within ``iteration_cap_s``, the time of a full-budget chunk at zero
     context (0.42 s at the pressure profile); the first request of an iteration always gets at
     least one token. Attention grows with the context (``A = chunk * before + chunk^2 / 2``),
     so at 300K context the bound takes ~1.3K tokens an iteration instead of 16K: per token
     the cost is the same (eq. 1 is linear in ``A``), the fixed cost ``c0`` is paid ~12x more
     often (~4% of the long prefill's time). SGLang's dynamic chunking and vLLM's
     ``long_prefill_token_threshold`` bound a long prompt's chunk for the same reason; this
     bounds its time;
  3. long share: a request whose expected remaining prefill exceeds ``LONG_S`` takes at most
     ``LONG_SHARE`` of an iteration's time while any shorter request is eligible, whatever its
     place in the order. Aged ahead of everything, a 300K-token cold prompt (~95 s of prefill)
     would otherwise hold every iteration to its end and the short requests behind it would
     wait those 95 s, the blocking this order exists to avoid; with the share they wait at
     most a bounded iteration, and the long one keeps half the node while they are there (at
     most twice its alone time), all of it when they are not.
"""

from __future__ import annotations

import math

from engine.backend import PrefillJob
from engine.profiles import Profile

PREFILL_ORDERS = ("fcfs", "short_first")
#: ``short_first``: a second of waiting counts as one second less of expected service.
AGING = 1.0
#: ``short_first``: a request expected to need more prefill than this (s) is long; while a
#: shorter one is eligible a long one takes at most ``LONG_SHARE`` of an iteration's time.
LONG_S = 5.0
LONG_SHARE = 0.5


def iteration_cap_s(p: Profile) -> float:
    """``short_first``'s bound on an iteration's predicted time: a full-budget chunk at zero
    context."""
    b = p.prefill_token_budget
    return p.prefill_iteration_s(b, b * (b + 1) / 2.0, 0.0)


def chunk_s(p: Profile, chunk: int, before: int) -> float:
    """Eq. 1's per-chunk time without the fixed cost and the restore: ``chunk`` new tokens at
    context ``before``."""
    return p.c1 * chunk + p.c2 * (chunk * before + chunk * (chunk + 1) / 2.0)


def remaining_s(p: Profile, job: PrefillJob) -> float:
    """Expected prefill time the job still needs (fixed costs left out): measured tokens once
    started, else those estimated at enqueue."""
    if job.started:
        return chunk_s(p, job.t_uc - job.done_uc, job.t_c + job.done_uc)
    return chunk_s(p, job.est_uc, max(0, job.prompt_tokens - job.est_uc))


def order_key(p: Profile, job: PrefillJob, now: float) -> tuple:
    return (-job.priority, remaining_s(p, job) - AGING * (now - job.enqueued_s), job.enqueued_s, job.request)


def chunk_within(p: Profile, time_left_s: float, before: int) -> int:
    """The most new tokens a chunk at context ``before`` may take within ``time_left_s`` (eq. 1's
    ``c1 * x + c2 * (x * before + x (x + 1) / 2)``; 0 when not even one fits)."""
    if time_left_s <= 0:
        return 0
    a = p.c2 / 2.0
    b = p.c1 + p.c2 * (before + 0.5)
    if a <= 0:
        return int(time_left_s / b) if b > 0 else 1 << 62
    return int((-b + math.sqrt(b * b + 4.0 * a * time_left_s)) / (2.0 * a))
