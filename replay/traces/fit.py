"""Workload calibration: the distributions of a workload, fitted generator parameters, KS fit quality.

Pure (no I/O): works on sessions in the trace format, so any source (imported real sessions,
a generator's output, a session file) is described by the same numbers.

- :func:`workload_samples` -- the per-distribution samples of a workload (prompt length,
  growth per turn, output length, tool and human pauses, session length, sub-agents,
  compactions, branch resumes) and its rates. What counts where is stated in ``SAMPLE_DOC``.
- :func:`fit_cc` -- :class:`replay.traces.workloads.CcParams` fitted to a workload: every
  distribution a quantile function of its samples, rates as counts over their exposure.
- :func:`compare` -- two workloads side by side: n, mean, p50, p90 of each distribution and
  the two-sample Kolmogorov-Smirnov distance (``scipy.stats.ks_2samp``), plus the rates.

``evolving trace fit SRC -o params.json`` and ``evolving trace stats --compare A B`` are the
commands (``replay/cli.py``); ``docs/traces.md`` has the fitted values and the fit quality.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.stats import ks_2samp

from replay.traces.format import Compact, Fork, Request, Session, Spawn
from replay.traces.workloads import CcParams, Quantiles

#: What each distribution holds (docs/traces.md repeats it).
SAMPLE_DOC: dict[str, str] = {
    "prompt tokens": "every request's prompt",
    "first prompt": "the root branch's first prompt",
    "growth per turn": "prompt - previous prompt, consecutive main-thread requests of one branch "
                       "and context version (no compaction or resume between)",
    "output tokens": "every request's output",
    "tool pause s": "pause before a request that appends a tool result (pause_kind tool), not a branch's first",
    "human pause s": "pause before a user turn (pause_kind human), not a branch's first",
    "main requests": "main-thread requests per session (root and its resumed branches)",
    "sub-agent requests": "requests per sub-agent",
    "sub-agent first prompt": "a sub-agent's first prompt",
    "sub-agent growth": "prompt growth between consecutive requests of a sub-agent",
    "compaction trigger": "prompt length of the request before a compaction",
    "compaction summary": "context length right after a compaction (its full blocks)",
    "resume kept": "share of the parent's last prompt a resumed branch keeps as its prefix",
    "resume ratio": "a resumed branch's first prompt / the parent's last prompt",
}
RATE_DOC: dict[str, str] = {
    "human share": "human pauses / (tool + human pauses)",
    "sub-agent groups per main request": "runs of consecutive spawns per main-thread request",
    "sub-agents per group": "spawns per run of consecutive spawns",
    "sub-agent wait share": "spawns the parent waits for",
    "compactions per session": "compactions / sessions",
    "resumes per main request": "resume forks / main-thread requests",
    "long-context share": "sessions whose prompt passes every observed compaction trigger without compacting",
}


def _prompt(r: Request, bt: int) -> int:
    return len(r.blocks) * bt + r.tail_tokens


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Samples:
    """Samples of each distribution and the counts behind the rates."""

    dists: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SAMPLE_DOC})
    sessions: int = 0
    main_requests: int = 0
    tool: int = 0
    human: int = 0
    spawns: int = 0  # main-thread spawns
    spawns_all: int = 0
    spawn_groups: int = 0
    waited: int = 0
    compactions: int = 0
    resumes: int = 0
    max_prompt: list[float] = field(default_factory=list)
    compacted: list[bool] = field(default_factory=list)
    first: list[float] = field(default_factory=list)  # per session, aligned with max_prompt

    def long_context(self) -> list[bool]:
        """Per session: its prompt passed every observed compaction trigger without compacting
        (a 1M-token window, no auto-compaction)."""
        trig = self.dists["compaction trigger"]
        hi = max(trig) if trig else float("inf")
        return [m > hi and not c for m, c in zip(self.max_prompt, self.compacted)]

    def rates(self) -> dict[str, float]:
        long_ctx = sum(self.long_context())
        return {
            "human share": self.human / max(1, self.tool + self.human),
            "sub-agent groups per main request": self.spawn_groups / max(1, self.main_requests),
            "sub-agents per group": self.spawns / max(1, self.spawn_groups),
            "sub-agent wait share": self.waited / max(1, self.spawns_all),
            "compactions per session": self.compactions / max(1, self.sessions),
            "resumes per main request": self.resumes / max(1, self.main_requests),
            "long-context share": long_ctx / max(1, self.sessions),
        }


def workload_samples(sessions: Sequence[Session]) -> Samples:
    """The distributions of ``sessions`` (see ``SAMPLE_DOC`` / ``RATE_DOC``)."""
    sm = Samples()
    d = sm.dists
    for s in sessions:
        bt = s.block_tokens
        sm.sessions += 1
        last_req: dict[str, Request] = {}
        main_n = 0
        top = 0
        compacted = False
        for bi, b in enumerate(s.branches):
            sub = b.mode == "subagent"
            prev: Request | None = None
            first = True
            in_group = False
            n_sub = 0
            for st in b.steps:
                if isinstance(st, Request):
                    p = _prompt(st, bt)
                    top = max(top, p)
                    d["prompt tokens"].append(p)
                    d["output tokens"].append(st.output_tokens)
                    if first:
                        if bi == 0:
                            d["first prompt"].append(p)
                            sm.first.append(p)
                        elif sub:
                            d["sub-agent first prompt"].append(p)
                        elif b.mode == "fork" and b.parent in last_req:
                            par = last_req[b.parent]
                            d["resume kept"].append(_common(par.blocks, st.blocks) / max(1, len(par.blocks)))
                            d["resume ratio"].append(p / max(1, _prompt(par, bt)))
                    else:
                        if st.pause_kind == "tool":
                            d["tool pause s"].append(st.pause_s)
                            sm.tool += 1
                        elif st.pause_kind == "human":
                            d["human pause s"].append(st.pause_s)
                            sm.human += 1
                    if prev is not None:
                        d["sub-agent growth" if sub else "growth per turn"].append(p - _prompt(prev, bt))
                    if sub:
                        n_sub += 1
                    else:
                        main_n += 1
                    prev, first, in_group = st, False, False
                    last_req[b.id] = st
                elif isinstance(st, Compact):
                    if prev is not None:
                        d["compaction trigger"].append(_prompt(prev, bt))
                    d["compaction summary"].append(len(st.blocks) * bt)
                    sm.compactions += 1
                    compacted = True
                    prev = None
                elif isinstance(st, Spawn):
                    sm.waited += st.wait
                    sm.spawns_all += 1
                    if not sub:  # the rates of the main thread (nested spawns are counted apart)
                        sm.spawns += 1
                        sm.spawn_groups += not in_group
                    in_group = True
                elif isinstance(st, Fork):
                    sm.resumes += 1
            if sub:
                d["sub-agent requests"].append(n_sub)
        d["main requests"].append(main_n)
        sm.main_requests += main_n
        sm.max_prompt.append(top)
        sm.compacted.append(compacted)
    return sm


# --------------------------------------------------------------------------- fitting
def fit_cc(sessions: Sequence[Session], base: CcParams | None = None, points: int = 101) -> CcParams:
    """CC generator parameters fitted to ``sessions`` (real Claude Code sessions, imported).

    Every distribution is the ``points``-point quantile function of its samples
    (:class:`~replay.traces.workloads.Quantiles`); the first prompt is fitted apart for the
    long-context sessions (``long_first_prompt``) and the others. Rates are counts over their
    exposure (``RATE_DOC``). A distribution with fewer than two samples keeps ``base``'s value."""
    base = base or CcParams()
    sm = workload_samples(sessions)
    d, r = sm.dists, sm.rates()

    def q(values: Sequence[float], old, integer: bool = True):
        return Quantiles.fit(values, points, integer=integer) if len(values) >= 2 else old

    long_ctx = sm.long_context()
    return replace(
        base,
        main_requests=q(d["main requests"], base.main_requests),
        first_prompt=q([f for f, lc in zip(sm.first, long_ctx) if not lc], base.first_prompt),
        long_first_prompt=q([f for f, lc in zip(sm.first, long_ctx) if lc], base.long_first_prompt),
        growth=q(d["growth per turn"], base.growth),
        output=q(d["output tokens"], base.output),
        tool_pause_s=q(d["tool pause s"], base.tool_pause_s, integer=False),
        human_pause_s=q(d["human pause s"], base.human_pause_s, integer=False),
        human_p=r["human share"] if sm.tool + sm.human else base.human_p,
        subagent_p=r["sub-agent groups per main request"],
        subagents_per_group=max(1.0, r["sub-agents per group"]) if sm.spawns else base.subagents_per_group,
        subagent_wait_p=r["sub-agent wait share"] if sm.spawns_all else base.subagent_wait_p,
        subagent_requests=q(d["sub-agent requests"], base.subagent_requests),
        subagent_first_prompt=q(d["sub-agent first prompt"], base.subagent_first_prompt),
        subagent_growth=q(d["sub-agent growth"], base.subagent_growth),
        compact_trigger=q(d["compaction trigger"], base.compact_trigger),
        compact_summary=q(d["compaction summary"], base.compact_summary),
        long_context_p=r["long-context share"],
        context_cap=int(max(sm.max_prompt)) if sm.max_prompt else base.context_cap,
        resume_p=r["resumes per main request"],
        resume_kept=q(d["resume kept"], base.resume_kept, integer=False),
        resume_ratio=q(d["resume ratio"], base.resume_ratio, integer=False),
    )


# --------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Row:
    name: str
    a: tuple[int, float, float, float]  # n, mean, p50, p90
    b: tuple[int, float, float, float]
    ks: float | None  # None when a side has no sample


def _summary(x: Sequence[float]) -> tuple[int, float, float, float]:
    if not len(x):
        return (0, 0.0, 0.0, 0.0)
    a = np.asarray(x, dtype=float)
    p50, p90 = np.percentile(a, [50, 90])
    return (len(a), float(a.mean()), float(p50), float(p90))


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sample Kolmogorov-Smirnov statistic (max distance between the empirical CDFs)."""
    if not len(a) or not len(b):
        return None
    return float(ks_2samp(np.asarray(a, float), np.asarray(b, float)).statistic)


def compare(a: Sequence[Session] | Samples, b: Sequence[Session] | Samples) -> tuple[list[Row], dict[str, tuple[float, float]]]:
    """Distributions of two workloads side by side with their KS distance, and the rates."""
    sa = a if isinstance(a, Samples) else workload_samples(a)
    sb = b if isinstance(b, Samples) else workload_samples(b)
    rows = [Row(k, _summary(sa.dists[k]), _summary(sb.dists[k]), ks_distance(sa.dists[k], sb.dists[k]))
            for k in SAMPLE_DOC]
    ra, rb = sa.rates(), sb.rates()
    return rows, {k: (ra[k], rb[k]) for k in RATE_DOC}


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.2f}" if abs(v) >= 1 else f"{v:.3f}"


def format_compare(rows: list[Row], rates: dict[str, tuple[float, float]], name_a: str, name_b: str,
                   markdown: bool = False) -> str:
    """The side-by-side table (plain text, or Markdown for docs)."""
    head = ["distribution", "n A", "mean A", "p50 A", "p90 A", "n B", "mean B", "p50 B", "p90 B", "KS"]
    body = []
    for r in rows:
        body.append([r.name, str(r.a[0]), _num(r.a[1]), _num(r.a[2]), _num(r.a[3]),
                     str(r.b[0]), _num(r.b[1]), _num(r.b[2]), _num(r.b[3]),
                     "-" if r.ks is None else f"{r.ks:.3f}"])
    rate_rows = [[k, _num(va), _num(vb)] for k, (va, vb) in rates.items()]
    if markdown:
        out = [f"A = {name_a}, B = {name_b}", "", "| " + " | ".join(head) + " |",
               "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in body]
        out += ["", "| rate | A | B |", "|---|---|---|"] + ["| " + " | ".join(x) + " |" for x in rate_rows]
        return "\n".join(out)
    w = [max(len(head[i]), *(len(x[i]) for x in body)) for i in range(len(head))]
    out = [f"A = {name_a}", f"B = {name_b}",
           "  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(head))]
    out += ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(x)) for x in body]
    wr = max(len(x[0]) for x in rate_rows)
    out += ["", f"{'rate'.ljust(wr)}  {'A':>10}  {'B':>10}"]
    out += [f"{x[0].ljust(wr)}  {x[1]:>10}  {x[2]:>10}" for x in rate_rows]
    return "\n".join(out)
