"""The fidelity workload: real agent sessions scaled down until CPU engines can serve them.

Pure: sessions in, sessions out; no clock, no I/O, no randomness. What is scaled, and how
(:class:`Scaling`; ``evolving fidelity`` prints it):

- **agents**: the first ``sessions`` sessions of the trace that fit the model's context once
  scaled, ``concurrency`` of them at a time (closed loop, as ``evolving drive`` replays them);
- **turns**: each session cut to its first ``turns`` requests (``soak.agents.cut_session``);
- **token lengths** divided by ``tokens``: every ``tokens`` consecutive 64-token blocks of the
  trace become one 64-token block named by the last of them (chained, so it names the whole
  prefix: two prompts that shared ``m`` trace blocks share ``m // tokens`` blocks), the leftover
  and the tail divided the same way; output lengths divided by ``output`` (at least 1, at most
  ``max_output``);
- **time**: pauses as autonomous agents take them (``--pace agent``: tool pauses capped at 60 s,
  a human's at 10 s), then times ``pause``.

The prefix structure (which request shares which prefix with which) is the trace's; only
lengths and times shrink.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from replay.traces.format import Branch, Request, Session, reblock
from replay.traces.pacing import Pace, pace_session
from services.drivers.soak.agents import cut_session

BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Scaling:
    """How the real sessions are shrunk (module docstring)."""

    sessions: int = 4
    concurrency: int = 4
    turns: int = 4
    tokens: int = 32
    output: int = 16
    max_output: int = 32
    pause: float = 0.05
    context_tokens: int = 8192  # the model's context: a scaled prompt + output must fit
    skip: int = 0  # sessions of the trace passed over first (held out for calibration)

    def describe(self) -> str:
        return (f"agents: {self.sessions} sessions (after skipping {self.skip}), {self.concurrency} at a time, "
                f"first {self.turns} requests each; token lengths / {self.tokens} (64-token blocks merged "
                f"{self.tokens} to 1); outputs / {self.output} (1..{self.max_output} tokens); pauses as agents "
                f"(tool <= 60 s, human <= 10 s) x {self.pause:g}")


def scale_session(s: Session, sc: Scaling) -> Session:
    """One session shrunk as ``sc`` says (module docstring)."""
    c = cut_session(s, sc.turns)
    merged = reblock(reblock(c, BLOCK_TOKENS), BLOCK_TOKENS * sc.tokens)  # k trace blocks -> 1
    branches = []
    for b in merged.branches:
        steps = []
        for st in b.steps:
            if isinstance(st, Request):
                out = max(1, min(sc.max_output, round(st.output_tokens / sc.output)))
                st = msgspec.structs.replace(st, tail_tokens=st.tail_tokens // sc.tokens, output_tokens=out)
            steps.append(st)
        branches.append(msgspec.structs.replace(b, steps=steps))
    shrunk = msgspec.structs.replace(merged, block_tokens=BLOCK_TOKENS, branches=branches)
    return pace_session(pace_session(shrunk, Pace(mode="agent")), Pace(mode="scale", factor=sc.pause))


def fits(s: Session, context_tokens: int) -> bool:
    """Every request's prompt + output fits ``context_tokens``."""
    return all(len(r.blocks) * s.block_tokens + r.tail_tokens + r.output_tokens <= context_tokens
               for _, _, r in s.requests())


def scaled_sessions(sessions: Iterable[Session], sc: Scaling) -> list[Session]:
    """The first ``sc.sessions`` sessions after ``sc.skip`` that fit the context once scaled."""
    out: list[Session] = []
    skipped = 0
    for s in sessions:
        shrunk = scale_session(s, sc)
        if not fits(shrunk, sc.context_tokens):
            continue
        if skipped < sc.skip:
            skipped += 1
            continue
        out.append(shrunk)
        if len(out) == sc.sessions:
            break
    return out


def workload_figures(sessions: Sequence[Session]) -> dict:
    """Requests, prompt tokens and output tokens of ``sessions`` (to print beside the scaling)."""
    n = prompt = output = 0
    for s in sessions:
        for _, _, r in s.requests():
            n += 1
            prompt += len(r.blocks) * s.block_tokens + r.tail_tokens
            output += r.output_tokens
    return {"sessions": len(sessions), "requests": n, "prompt_tokens": prompt, "output_tokens": output}


#: the first block hash of the calibration sweep's prompts: a run of consecutive 64-bit values,
#: which a trace's chained 64-bit block hashes hit with negligible probability, so a sweep prompt
#: shares no prefix with the sessions (the sweep's own prompts use disjoint runs)
SWEEP_BASE = (1 << 63) + (1 << 62)


def prefill_sweep(lengths: Sequence[int], *, output_tokens: int = 4, block_tokens: int = 64) -> list[Session]:
    """One single-request session per prompt length (tokens, rounded down to whole blocks), cold
    (blocks no trace and no other sweep prompt has): what a pre-deployment profiling run does
    (Dynamo's ``profile_sla`` sweeps the input length). The calibration sessions alone reach a
    few hundred uncached tokens an iteration, so the fit extrapolated eq. 1's attention term 20x
    to the test's 2,048-token chunks (docs/simulator.md, section 9)."""
    out = []
    nxt = SWEEP_BASE
    for i, n in enumerate(lengths):
        k = max(1, int(n) // block_tokens)
        blocks = list(range(nxt, nxt + k))
        nxt += k
        req = Request(blocks=blocks, output_tokens=output_tokens)
        out.append(Session(id=f"sweep-{i}-{k * block_tokens}", block_tokens=block_tokens, source="fidelity:sweep",
                           branches=[Branch(id="main", steps=[req])]))
    return out
