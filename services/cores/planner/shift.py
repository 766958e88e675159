"""The change-point test of the planner's shift path: has the mix changed
within the sliding window? Pure: no I/O, no clock; sums exactly rounded (``numerics.total``), so
a replay on any machine takes the same decision.

Between window ends the Evolving planner looks, at every slice end, at the sliding window of the
last ``slices`` slices split in two: the ``older`` slices and the ``recent`` ones (the last
``shift_slices``). A signal has shifted when its recent mean differs from its older mean by more
than twice the standard error of that difference (Welch: ``sqrt(var_r / n_r + var_o / n_o)``,
sample variances with ddof = 1), in the direction that asks for a change:

- ``gain <P>P``: per slice, the predicted throughput gain of candidate P over the current split
  (eq. 6 at that slice's ``w_bar``); shifted when it rose and its recent mean is positive;
- ``prefill queue``: per slice, the measured mean number of requests waiting for prefill in the
  cluster; shifted when it rose (the queue-driven signal: the split no longer keeps up).

A shift only opens the decision: the switch still needs the recent slices' mean gain > 2 SE
(or the SLO escape at no predicted throughput loss) and no cooldown (evolving.py).
"""

from __future__ import annotations

import math

import services.cores.numerics as nm
from events.catalog import ShiftTest


def passed(t: ShiftTest) -> bool:
    """The signal rose by more than twice the SE of the rise."""
    rise = t.recent - t.older
    return rise > 2.0 * t.se and rise > 0.0


def why(t: ShiftTest) -> str:
    rise = t.recent - t.older
    return (
        f"{t.signal} {t.older:.3g} -> {t.recent:.3g} over the last {t.n_recent} slice(s), "
        f"rise {rise:.3g} > 2 SE ({2.0 * t.se:.3g})"
    )


def _mean_var(x: list[float]) -> tuple[float, float]:
    n = len(x)
    mean = nm.total(x) / n
    var = nm.total([(v - mean) ** 2 for v in x]) / (n - 1) if n > 1 else math.inf
    return mean, var


def change_point(signal: str, older: list[float], recent: list[float]) -> ShiftTest | None:
    """The Welch statistics of ``recent`` against ``older``; ``None`` with fewer than two values
    on either side (no variance, no SE)."""
    if len(older) < 2 or len(recent) < 2:
        return None
    mo, vo = _mean_var(older)
    mr, vr = _mean_var(recent)
    se = math.sqrt(vr / len(recent) + vo / len(older))
    return ShiftTest(signal=signal, recent=mr, older=mo, se=se, n_recent=len(recent), n_older=len(older))


def strongest(tests: list[ShiftTest]) -> ShiftTest | None:
    """The passing shift with the largest rise in SE units (ties: the first, i.e. the caller's
    order), ``None`` when none passes."""
    passing = [t for t in tests if passed(t)]
    if not passing:
        return None
    return max(passing, key=lambda t: (t.recent - t.older) / t.se if t.se > 0 else math.inf)
