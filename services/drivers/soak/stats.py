"""The soak's accounting and flatness verdicts: pure functions of what was measured (no I/O,
no clock), so the unit and property tests drive them directly.

* :func:`nearest_rank` - the percentile benchmark_serving and ``evolving drive`` report (a value
  of the sample, never an interpolation between two).
* :func:`intervals` - the requests bucketed by the second they were sent in: per interval,
  sent / answered / failed and p50 / p99 of TTFT and end-to-end latency.
* :func:`flat` - the slope of a series over the second half of the run (Theil-Sen: the median
  of pairwise slopes, so one step of an allocator or one slow scrape does not make a trend),
  judged against a threshold.
* :func:`recorded_check` - every event on the stream up to the end of the load is a row of the
  recorder's log.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.stats import theilslopes


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it. Times are seconds since the soak's load started."""

    sent_s: float
    ok: bool
    ttft_s: float | None = None  # first content token after sending (None: no token came)
    e2e_s: float = 0.0  # sending to the last byte (or to the failure)
    wait_s: float = 0.0  # Poisson arrival to sending: the time it waited for a free agent stream
    error: str = ""


def nearest_rank(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0 < q <= 1) by nearest rank: ``sorted(xs)[ceil(q n) - 1]``; None if empty."""
    if not 0.0 < q <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


@dataclass
class Interval:
    start_s: float
    sent: int = 0
    answered: int = 0
    failed: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None
    wait_p99_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def intervals(outcomes: Sequence[Outcome], interval_s: float, duration_s: float,
              in_flight_sent_s: Sequence[float] = ()) -> list[Interval]:
    """Requests bucketed by the interval they were sent in, ``[k * interval_s, (k+1) * interval_s)``
    for every interval that starts before ``duration_s``. ``in_flight_sent_s``: send times of
    requests with no outcome yet (they count as sent only). Latency percentiles are over the
    answered requests of the interval."""
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    n = max(1, math.ceil(duration_s / interval_s))
    rows = [Interval(start_s=k * interval_s) for k in range(n)]

    def slot(t: float) -> int:
        return min(n - 1, max(0, int(t // interval_s)))

    per: list[list[Outcome]] = [[] for _ in range(n)]
    for o in outcomes:
        per[slot(o.sent_s)].append(o)
    for t in in_flight_sent_s:
        rows[slot(t)].sent += 1
    for row, os_ in zip(rows, per, strict=True):
        row.sent += len(os_)
        good = [o for o in os_ if o.ok]
        row.answered, row.failed = len(good), len(os_) - len(good)
        ttft = [o.ttft_s for o in good if o.ttft_s is not None]
        e2e = [o.e2e_s for o in good]
        row.ttft_p50_s, row.ttft_p99_s = nearest_rank(ttft, 0.5), nearest_rank(ttft, 0.99)
        row.e2e_p50_s, row.e2e_p99_s = nearest_rank(e2e, 0.5), nearest_rank(e2e, 0.99)
        row.wait_p99_s = nearest_rank([o.wait_s for o in os_], 0.99)
    return rows


def second_half(ts: Sequence[float], ys: Sequence[float | None]) -> tuple[np.ndarray, np.ndarray]:
    """The points at or after the middle of the series' time span (missing values dropped)."""
    pts = [(t, y) for t, y in zip(ts, ys, strict=True) if y is not None and math.isfinite(y)]
    if not pts:
        return np.empty(0), np.empty(0)
    mid = (pts[0][0] + pts[-1][0]) / 2
    keep = [(t, y) for t, y in pts if t >= mid]
    return np.array([t for t, _ in keep], dtype=float), np.array([y for _, y in keep], dtype=float)


def slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Theil-Sen slope of ``ys`` against ``ts`` (seconds), per minute; 0 for fewer than 3 points
    or a single instant."""
    t, y = np.asarray(ts, dtype=float), np.asarray(ys, dtype=float)
    if len(t) < 3 or float(np.ptp(t)) == 0.0:
        return 0.0
    return float(theilslopes(y, t).slope) * 60.0


@dataclass
class Flatness:
    """A series judged flat or not over the second half of the run."""

    name: str  # e.g. "rss router", "fds gateway", "e2e p99"
    unit: str  # of the slope: "MB/min", "fds/min", "s/min"
    slope: float
    limit: float
    points: int
    median: float | None = None  # of the judged points (the base of a relative limit)
    judged: bool = True  # False: shown, not part of the verdict (too few points, or not asked)

    @property
    def ok(self) -> bool:
        return not self.judged or self.slope <= self.limit

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, slope=round(self.slope, 4), limit=round(self.limit, 4))
        if self.median is not None:
            d["median"] = round(self.median, 5)
        return d


def flat(name: str, ts: Sequence[float], ys: Sequence[float | None], *, limit: float, unit: str,
         relative: bool = False, floor: float = 0.0, min_points: int = 5) -> Flatness:
    """Judge the Theil-Sen slope (per minute) of the series' second half. ``relative``: the limit
    is a fraction of the second half's median per minute (latency), never below ``floor``.
    Fewer than ``min_points`` points in the second half: reported, not judged. Only growth
    fails: a falling series is flat enough for a soak (memory given back, latency improving)."""
    t, y = second_half(ts, ys)
    med = float(np.median(y)) if len(y) else None
    lim = max(floor, limit * med) if relative and med is not None else limit
    return Flatness(name, unit, slope_per_min(t, y), lim, len(y), med, judged=len(y) >= min_points)


@dataclass
class Recorded:
    """Stream events up to the end of the load against the recorder's rows."""

    stream_head: int  # the stream's last sequence when the load had finished
    stream_messages: int  # messages the stream held up to that head
    recorded: int  # rows of the log with seq <= stream_head
    dead_letters: int = 0  # messages in the partition's dead-letter stream
    log_rows: int = 0  # every row of the log (after the stack stopped: also the shutdown's events)
    log_max_seq: int = 0

    @property
    def missing(self) -> int:
        return max(0, self.stream_messages - self.recorded)

    @property
    def ok(self) -> bool:
        gapless = self.log_rows == 0 or self.log_rows == self.log_max_seq
        return (self.stream_messages > 0 and self.recorded == self.stream_messages and self.dead_letters == 0
                and gapless)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "missing": self.missing, "ok": self.ok}


def recorded_check(stream_head: int, stream_messages: int, recorded: int, dead_letters: int = 0,
                   log_rows: int = 0, log_max_seq: int = 0) -> Recorded:
    return Recorded(stream_head, stream_messages, recorded, dead_letters, log_rows, log_max_seq)


def poisson_floor(expected: float, sigmas: float = 3.0) -> float:
    """The fewest arrivals a Poisson process of mean ``expected`` gives short of a stall:
    ``expected - sigmas * sqrt(expected)`` (a stack that keeps up sends at least this many)."""
    return max(0.0, expected - sigmas * math.sqrt(expected))


@dataclass
class Verdict:
    """Why the soak passes or fails (each reason one line)."""

    reasons: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.reasons


def verdict(*, sent: int, answered: int, failed: int, expected_arrivals: float, recorded: Recorded | None,
            verify_ok: bool | None, flatness: Sequence[Flatness], restarts: Sequence[str] = ()) -> Verdict:
    """Every reason the soak fails: a failed or unanswered request, an unrecorded event, a
    failed ``verify``, a process restarted, a series that grows, or a client that could not keep
    the Poisson rate (fewer sent than ``poisson_floor(expected_arrivals)``)."""
    v = Verdict()
    if failed:
        v.reasons.append(f"{failed} request(s) failed")
    if answered + failed < sent:
        v.reasons.append(f"{sent - answered - failed} request(s) never answered")
    if sent < poisson_floor(expected_arrivals):
        v.reasons.append(f"sent {sent} requests, fewer than the Poisson floor "
                         f"{poisson_floor(expected_arrivals):.0f} of {expected_arrivals:.0f} expected: "
                         "the agent streams were all busy (the stack did not keep up)")
    if recorded is not None and not recorded.ok:
        v.reasons.append(f"recorder: {recorded.recorded} of {recorded.stream_messages} stream events recorded, "
                         f"{recorded.dead_letters} dead-lettered, log rows {recorded.log_rows} "
                         f"vs max seq {recorded.log_max_seq}")
    if verify_ok is False:
        v.reasons.append("verify: the recorded decisions were not reproduced")
    v.reasons += [f"restarted: {r}" for r in restarts]
    v.reasons += [f"not flat: {f.name} grows {f.slope:.3g} {f.unit} (limit {f.limit:.3g})"
                  for f in flatness if not f.ok]
    return v
