"""Pacing: how the client-side pauses of a workload are replayed (``--pace`` on replay/compare).

Pure: ``pace_session(session, pace)`` returns a new session; no clock, no randomness.

- ``recorded`` -- every pause as recorded (a human's think time included). The session itself
  is returned.
- ``agent[:TOOL_CAP[:HUMAN_CAP]]`` -- the recorded fleet replayed as **autonomous agents**:
  tool time is kept, human pauses are capped. Default caps: tool 60 s, human 10 s.
  How a pause is told apart (``Request.pause_kind``, set by the importers from the source):
  - ``human`` (kv-cache-tester ``input_types`` without ``"tool_result"``: the prompt appends a
    user turn): capped at ``HUMAN_CAP`` -- an agent's next instruction comes from its
    orchestrator, not from a person reading the answer;
  - ``tool`` (``input_types`` holds ``"tool_result"``): capped at ``TOOL_CAP`` -- a tool result
    that took longer is a person approving a permission prompt or a long build the paper's
    agents did not wait for. On the 100 calibration sessions tool pauses have p50 8 s, p75 19 s,
    p90 82 s; 88% are under 60 s;
  - unknown kind (Mooncake, old session files): the think-time distribution is the only
    signal, and the tool cap applies (on the calibration data human pauses have p25 39 s and
    p50 139 s, so the cap removes nearly all human time and keeps nearly all tool time).
  Fork/Spawn pauses (harness time) are capped at ``TOOL_CAP``. On the 100 calibration
  sessions the mean pause goes from 183 s (recorded) to ~16 s, inside METHOD.md §5's
  13-19 s for CC. Requests pinned by ``at_s`` (open-loop traces) keep their times.
- ``scale:X`` -- every pause (and ``at_s``) times ``X`` (``scale:0.5`` replays twice as fast).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from replay.traces.format import Fork, Request, Session, Spawn, Step

TOOL_CAP_S = 60.0
HUMAN_CAP_S = 10.0


@dataclass(frozen=True)
class Pace:
    mode: str = "recorded"  # recorded | agent | scale
    factor: float = 1.0
    tool_cap_s: float = TOOL_CAP_S
    human_cap_s: float = HUMAN_CAP_S

    def __str__(self) -> str:
        if self.mode == "agent":
            return f"agent:{self.tool_cap_s:g}:{self.human_cap_s:g}"
        return f"scale:{self.factor:g}" if self.mode == "scale" else "recorded"


def parse_pace(text: str) -> Pace:
    """``recorded``, ``agent``, ``agent:TOOL_CAP``, ``agent:TOOL_CAP:HUMAN_CAP`` or ``scale:X``."""
    parts = str(text).strip().lower().split(":")
    try:
        if parts == ["recorded"]:
            return Pace()
        if parts[0] == "agent" and len(parts) <= 3:
            caps = [float(x) for x in parts[1:]]
            tool = caps[0] if caps else TOOL_CAP_S
            human = caps[1] if len(caps) > 1 else min(HUMAN_CAP_S, tool)
            if tool < 0 or human < 0:
                raise ValueError
            return Pace("agent", tool_cap_s=tool, human_cap_s=human)
        if parts[0] == "scale" and len(parts) == 2:
            x = float(parts[1])
            if not x >= 0 or x == float("inf"):
                raise ValueError
            return Pace("scale", factor=x)
    except ValueError:
        pass
    raise ValueError(f"bad pace {text!r}: use recorded, agent[:TOOL_CAP[:HUMAN_CAP]] or scale:X (X >= 0)")


def _pause(p: float, kind: str, pace: Pace) -> float:
    if pace.mode == "scale":
        return p * pace.factor
    return min(p, pace.human_cap_s if kind == "human" else pace.tool_cap_s)


def pace_session(s: Session, pace: Pace) -> Session:
    """``s`` with its pauses replayed as ``pace`` says (see the module docstring)."""
    if pace.mode == "recorded" or (pace.mode == "scale" and pace.factor == 1.0):
        return s
    branches = []
    for b in s.branches:
        steps: list[Step] = []
        for st in b.steps:
            if isinstance(st, Request):
                at = st.at_s * pace.factor if (st.at_s is not None and pace.mode == "scale") else st.at_s
                p = round(_pause(st.pause_s, st.pause_kind, pace), 3)
                if p != st.pause_s or at != st.at_s:  # an unchanged step is kept (an equal struct, not copied)
                    st = msgspec.structs.replace(st, pause_s=p, at_s=at)
            elif isinstance(st, (Fork, Spawn)):
                p = round(_pause(st.pause_s, "tool", pace), 3)
                if p != st.pause_s:
                    st = msgspec.structs.replace(st, pause_s=p)
            steps.append(st)
        branches.append(msgspec.structs.replace(b, steps=steps))
    return msgspec.structs.replace(s, branches=branches)


def pace_sessions(sessions: Sequence[Session], pace: Pace | str) -> list[Session]:
    p = parse_pace(pace) if isinstance(pace, str) else pace
    return [pace_session(s, p) for s in sessions]
