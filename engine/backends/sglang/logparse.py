"""Decode iteration timing from SGLang's scheduler log (pure, no I/O).

Source: the line SGLang's scheduler logs every ``--decode-log-interval`` decode iterations
(default 40; sglang/srt/managers/scheduler_components/metrics_reporter.py)::

    [2026-12-01 10:00:00 TP0] Decode batch, #running-req: 12, #token: 40960, token usage: 0.05, ...,
    cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 0

``gen throughput`` is the tokens generated since the previous such line divided by the time
between them, so one iteration took ``running * accept_len / throughput`` seconds on average
over the interval (SGLang's own ``RECORD_STEP_TIME`` divides the same gap by the interval).
Each line becomes one ``IterationDone(phase="decode", iterations=interval)`` - eq. 2 gets one
sample per interval at the interval's final batch size. What the models lose: the batch size
is the one at the end of the interval (admissions inside it blur the sample), and prefill
logs carry token counts but no duration, so eq. 1 gets no samples from an SGLang node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DECODE = re.compile(
    r"Decode batch(?: \[\d+\])?, #running-req: (?P<running>\d+),.*?"
    r"(?:accept len: (?P<accept>[0-9.]+),.*?)?"
    r"gen throughput \(token/s\): (?P<tput>[0-9.]+), #queue-req: (?P<queued>\d+)")


@dataclass(frozen=True, slots=True)
class DecodeStat:
    running: int
    throughput_tps: float
    queued: int
    accept_len: float = 1.0

    def iteration_s(self) -> float | None:
        """Mean decode iteration time over the interval (None when it cannot be known)."""
        if self.running <= 0 or self.throughput_tps <= 0:
            return None
        return self.running * self.accept_len / self.throughput_tps


def parse_decode_line(line: str) -> DecodeStat | None:
    m = _DECODE.search(line)
    if m is None:
        return None
    accept = float(m["accept"]) if m["accept"] else 1.0
    return DecodeStat(running=int(m["running"]), throughput_tps=float(m["tput"]), queued=int(m["queued"]),
                      accept_len=accept if accept > 0 else 1.0)
