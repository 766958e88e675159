"""Trace statistics: counts, token and pause distributions, and the ideal prefix-hit rate.

Pure: takes sessions, returns a :class:`TraceStats` (printable, JSON-encodable).

The **ideal prefix-hit rate** is the denominator of "lost KV reuse" (METHOD.md §1): with an
ideal cache (every node shares all KV, no limit, nothing evicted), a prompt's hit tokens are
its longest prefix of full blocks that appeared in the prompt of any *earlier* request of the
workload (chained hashes: a block seen implies its whole prefix was seen). "Earlier" is the
submission order of a replay with instant responses (``session_events`` with 0 s service,
sessions at their ``start_s``, or all at 0 for a closed-loop pool; ties in session order).
Output tokens whose KV the decode produced count only once they reappear as a full block of a
later prompt that an earlier prompt also held, so the rate is a lower bound at block
granularity. Partial tail blocks never count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from events.catalog import RequestSubmitted
from replay.traces.format import Compact, Fork, Request, Session, Spawn, session_events


class Dist(msgspec.Struct, frozen=True, kw_only=True):
    """Summary of a distribution (0 everywhere when empty)."""

    n: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    total: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not len(values):
            return cls()
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(n=len(a), mean=float(a.mean()), p50=float(p50), p90=float(p90),
                   p99=float(p99), max=float(a.max()), total=float(a.sum()))


class TraceStats(msgspec.Struct, frozen=True, kw_only=True):
    sessions: int
    requests: int
    branches: int
    subagents: int
    forks: int
    compactions: int
    approximate: bool
    prompt_tokens: Dist
    output_tokens: Dist
    pause_s: Dist  # pauses before every request except the first of a root or sub-agent branch
    ideal_hit_tokens: int
    ideal_hit_rate: float  # ideal_hit_tokens / total prompt tokens


def ideal_hits(sessions: Sequence[Session]) -> tuple[int, int]:
    """(ideal hit tokens, prompt tokens) over the workload (see the module docstring)."""
    subs: list[tuple[float, int, int, RequestSubmitted]] = []
    for k, s in enumerate(sessions):
        t0 = s.start_s or 0.0
        for j, e in enumerate(session_events(s, 0.0, t0=t0)):
            if isinstance(e, RequestSubmitted):
                subs.append((e.ts, k, j, e))
    subs.sort(key=lambda x: x[:3])
    seen: set[int] = set()
    hit = total = 0
    for _ts, _k, _j, e in subs:
        n = 0
        for b in e.blocks:
            if b not in seen:
                break
            n += 1
        hit += n * e.block_tokens
        total += e.prompt_tokens
        seen.update(e.blocks)
    return hit, total


def trace_stats(sessions: Iterable[Session]) -> TraceStats:
    ss = list(sessions)
    prompts: list[int] = []
    outputs: list[int] = []
    pauses: list[float] = []
    subagents = forks = compactions = branches = 0
    for s in ss:
        branches += len(s.branches)
        for b in s.branches:
            first = b.mode != "fork"  # a fork's first request follows its parent's last one
            for st in b.steps:
                if isinstance(st, Request):
                    prompts.append(len(st.blocks) * s.block_tokens + st.tail_tokens)
                    outputs.append(st.output_tokens)
                    if not first:
                        pauses.append(st.pause_s)
                    first = False
                elif isinstance(st, Spawn):
                    subagents += 1
                elif isinstance(st, Fork):
                    forks += 1
                elif isinstance(st, Compact):
                    compactions += 1
    hit, total = ideal_hits(ss)
    return TraceStats(
        sessions=len(ss), requests=len(prompts), branches=branches, subagents=subagents,
        forks=forks, compactions=compactions, approximate=any(s.approximate for s in ss),
        prompt_tokens=Dist.of(prompts), output_tokens=Dist.of(outputs), pause_s=Dist.of(pauses),
        ideal_hit_tokens=hit, ideal_hit_rate=hit / total if total else 0.0,
    )


def format_stats(st: TraceStats, title: str = "") -> str:
    """Plain-text report (one screen)."""
    lines = [title] if title else []
    approx = "  (approximate tokenisation)" if st.approximate else ""
    lines += [
        (f"sessions {st.sessions}   requests {st.requests}   branches {st.branches}   "
        f"sub-agents {st.subagents}   forks {st.forks}   compactions {st.compactions}{approx}"),
        f"{'':16}{'n':>8}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}{'max':>12}",
    ]
    for name, d in (("prompt tokens", st.prompt_tokens), ("output tokens", st.output_tokens),
                    ("pause s", st.pause_s)):
        lines.append(f"{name:16}{d.n:>8}{d.mean:>12.1f}{d.p50:>12.1f}{d.p90:>12.1f}"
                     f"{d.p99:>12.1f}{d.max:>12.1f}")
    lines.append(f"ideal prefix hits {st.ideal_hit_tokens} of {int(st.prompt_tokens.total)} prompt "
                 f"tokens = {st.ideal_hit_rate:.1%}")
    return "\n".join(lines)
