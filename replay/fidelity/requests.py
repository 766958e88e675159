"""Request by request: where a simulated TTFT differs from the live one.

A stack's TTFT percentiles say *that* the two sides differ; this says in which part of the
request's path. Each request's TTFT, from its log alone, is split into

- ``queue_s``: ``RequestSubmitted`` to ``RequestStarted(prefill)``: routing and the wait in the
  node's queue (the router core stamps its decision with the submission's ``ts`` on both sides,
  so the router's own latency, live, is inside this part);
- ``service_s``: that start to ``FirstToken`` (the prefill iterations it ran in).

The two logs name branches differently (the live driver's ``fid-STACK-N:`` prefix, the
simulator's agent ``aN:``), so a request is matched by its branch without that prefix (what follows
the last ``:``, e.g. ``trace_0141/main``) and its place among that branch's requests in
submission order. The report (:func:`split_ratios`) gives, per part, the median of
the per-request ratios sim / live over the requests where both sides spent at least
``floor_s`` in that part (a ratio of two near-zero waits says nothing; how many counted is
given), and the part's total seconds on each side, which says what carries the difference.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from events.catalog import Event, FirstToken, RequestStarted, RequestSubmitted

PARTS = ("queue_s", "service_s", "ttft_s")


@dataclass(frozen=True)
class RequestTimes:
    key: str  # branch#n (module docstring)
    submitted: float
    prompt_tokens: int
    queue_s: float
    service_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.service_s


def branch_of(branch: str) -> str:
    """``fid-static:1P1D-2:trace_0141/main`` and ``a2:trace_0141/main`` -> ``trace_0141/main``."""
    return branch.rsplit(":", 1)[-1]


def request_times(events: Iterable[Event]) -> dict[str, RequestTimes]:
    """Every request with a first token, keyed branch#n (the n-th of its branch by submission)."""
    sub: dict[str, RequestSubmitted] = {}
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    for e in events:
        match e:
            case RequestSubmitted():
                sub.setdefault(e.request, e)
            case RequestStarted() if e.phase == "prefill":
                started[e.request] = e.ts  # the last start (a displaced prefill starts again)
            case FirstToken():
                first.setdefault(e.request, e.ts)
    out: dict[str, RequestTimes] = {}
    seen: dict[str, int] = {}
    for rid, s in sorted(sub.items(), key=lambda kv: (kv[1].ts, kv[0])):
        b = branch_of(s.branch or rid.rsplit("/", 1)[0])
        n = seen.get(b, 0)
        seen[b] = n + 1
        if rid not in first:
            continue
        ft = first[rid]
        st = min(started.get(rid, ft), ft)
        out[f"{b}#{n}"] = RequestTimes(key=f"{b}#{n}", submitted=s.ts, prompt_tokens=s.prompt_tokens,
                                       queue_s=max(0.0, st - s.ts), service_s=ft - st)
    return out


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    m = len(ys) // 2
    return ys[m] if len(ys) % 2 else (ys[m - 1] + ys[m]) / 2


def split_ratios(live: dict[str, RequestTimes], sim: dict[str, RequestTimes], floor_s: float = 0.05) -> dict:
    """Per part: ``{"median_ratio", "counted", "live_total_s", "sim_total_s"}`` over the requests
    both sides served (module docstring); ``matched`` is how many."""
    keys = sorted(live.keys() & sim.keys())
    out: dict = {"matched": len(keys), "live_only": len(live.keys() - sim.keys()),
                 "sim_only": len(sim.keys() - live.keys()), "floor_s": floor_s}
    for part in PARTS:
        pairs = [(getattr(live[k], part), getattr(sim[k], part)) for k in keys]
        ratios = [s / lv for lv, s in pairs if lv >= floor_s and s >= floor_s]
        med = _median(ratios)
        out[part] = {"median_ratio": None if med is None else round(med, 3), "counted": len(ratios),
                     "live_total_s": round(sum(lv for lv, _ in pairs), 3),
                     "sim_total_s": round(sum(s for _, s in pairs), 3)}
    return out


def format_split(stack: str, split: dict) -> str:
    """One line: each part's median ratio sim / live and its seconds on both sides."""
    def part(p: str) -> str:
        d = split[p]
        med = "-" if d["median_ratio"] is None else f"{d['median_ratio']:.2f}x"
        return f"{p[:-2]} {med} (n={d['counted']}; {d['live_total_s']:.1f} s live / {d['sim_total_s']:.1f} s sim)"
    return (f"{stack}: per request sim/live, median over {split['matched']} matched: "
            + ", ".join(part(p) for p in PARTS))
