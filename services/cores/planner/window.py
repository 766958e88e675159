"""Per-slice workload statistics of a planning window (METHOD.md §4.3) and the mean work per
request ``w_bar`` and mean decode population ``q_bar`` derived from them.

Pure: no I/O, no clock. A slice is ``[k * slice_s, (k + 1) * slice_s)`` of event time; events
land in the slice of their ``ts``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import msgspec

from services.cores.costmodel import prefill_A

#: upper edges (s) of the buckets of ``SliceStats.wait_hist``; the last bucket is open
WAIT_EDGES_S = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 25.0,
                30.0, 40.0, 60.0, 90.0, 120.0, 180.0, 300.0)


class SliceStats(msgspec.Struct, kw_only=True):
    """Sums over one slice; every mean is a ratio of two of these (so windows add up)."""

    # requests placed by the acting router (RouteDecided, not shadow, not reroute)
    routed: int = 0
    sum_t_uc: float = 0.0
    sum_t_c: float = 0.0
    sum_A: float = 0.0
    # second moments of the routed requests' work (the spread of prefill service times: the
    # P95 TTFT prediction, docs/planner.md "Queueing prediction")
    sum_t_uc2: float = 0.0
    sum_t_c2: float = 0.0
    sum_A2: float = 0.0
    sum_uc_A: float = 0.0
    sum_uc_c: float = 0.0
    sum_A_c: float = 0.0
    # arrivals (RequestSubmitted)
    submitted: int = 0
    sum_prompt: float = 0.0
    sum_prompt_A: float = 0.0  # query-key pairs if the whole prompt were computed (Arrow's view)
    sum_max_tokens: float = 0.0
    # a branch's time from one request's submission to its next (the agents' closed-loop cycle)
    cycles: int = 0
    sum_cycle_s: float = 0.0
    # completions (RequestFinished without error)
    finished: int = 0
    sum_t_out: float = 0.0
    # decode iterations (IterationDone phase=decode)
    dec_iters: int = 0
    dec_batch: float = 0.0  # sum of batch
    dec_accepted: float = 0.0  # sum of accepted tokens
    dec_fwd: float = 0.0  # sum of t_fwd * batch
    dec_busy_s: float = 0.0
    # per decode node: [sum of (batch + queued) * duration_s, sum of duration_s]
    dec_occupancy: dict[str, list[float]] = {}
    # prefill iterations (IterationDone phase=prefill)
    pre_iters: int = 0
    pre_t_uc: float = 0.0
    pre_t_c: float = 0.0
    pre_t_rst: float = 0.0
    pre_busy_s: float = 0.0
    pre_queue: float = 0.0  # sum of queued * duration_s
    # prefill-queue waits (route to prefill start) of the requests whose prefill started in
    # the slice: their count, sum and histogram (buckets ``WAIT_EDGES_S``)
    waited: int = 0
    sum_wait_s: float = 0.0
    wait_hist: list[int] = []

    def empty(self) -> bool:
        return (
            self.routed == 0
            and self.submitted == 0
            and self.finished == 0
            and self.dec_iters == 0
            and self.pre_iters == 0
        )

    def add(self, o: SliceStats) -> None:
        for f in self.__struct_fields__:
            if f not in ("dec_occupancy", "wait_hist"):
                setattr(self, f, getattr(self, f) + getattr(o, f))
        if o.wait_hist:
            h = self.wait_hist or [0] * len(o.wait_hist)
            self.wait_hist = [a + b for a, b in zip(h, o.wait_hist, strict=True)]

    def decode_population(self) -> float:
        """Requests in decode (running + waiting), whole cluster: per node the duration-weighted
        mean over its decode iterations of the slice, summed over nodes."""
        return sum(
            num / den for num, den in (self.dec_occupancy[n] for n in sorted(self.dec_occupancy)) if den > 0
        )

    # ---------------------------------------------------------------- folding events
    def on_route(self, t_uc: int, t_c: int) -> None:
        self.routed += 1
        self._work(t_uc, t_c, 1.0)

    def on_started(self, routed: tuple[int, int], found: tuple[int, int]) -> None:
        """A request counted here at its route with ``routed = (t_uc, t_c)`` (the router's plan)
        started its prefill with ``found`` (what the engine really had cached): its work is
        corrected to the measured one, so reuse lost while it queued (evicted, a fetch that
        found no room) shows in the window's per-request work."""
        if routed != found:
            self._work(*routed, -1.0)
            self._work(*found, 1.0)

    def _work(self, t_uc: int, t_c: int, sign: float) -> None:
        self.sum_t_uc += sign * t_uc
        self.sum_t_c += sign * t_c
        A = prefill_A(t_uc, t_c)
        self.sum_A += sign * A
        self.sum_t_uc2 += sign * float(t_uc) * t_uc
        self.sum_t_c2 += sign * float(t_c) * t_c
        self.sum_A2 += sign * A * A
        self.sum_uc_A += sign * t_uc * A
        self.sum_uc_c += sign * float(t_uc) * t_c
        self.sum_A_c += sign * A * t_c

    def on_wait(self, wait_s: float) -> None:
        """A request's prefill started ``wait_s`` after its route."""
        wait_s = max(0.0, wait_s)
        if not self.wait_hist:
            self.wait_hist = [0] * (len(WAIT_EDGES_S) + 1)
        self.waited += 1
        self.sum_wait_s += wait_s
        self.wait_hist[bisect.bisect_left(WAIT_EDGES_S, wait_s)] += 1

    def wait_quantile_s(self, q: float) -> float:
        """The ``q`` quantile of the waits, linear within its bucket (the open last bucket:
        its lower edge); 0 without waits."""
        if self.waited <= 0 or not self.wait_hist:
            return 0.0
        rank = q * self.waited
        below = 0
        for i, n in enumerate(self.wait_hist):
            if n > 0 and below + n >= rank:
                lo = WAIT_EDGES_S[i - 1] if i > 0 else 0.0
                if i == len(WAIT_EDGES_S):
                    return lo
                return lo + (WAIT_EDGES_S[i] - lo) * (rank - below) / n
            below += n
        return WAIT_EDGES_S[-1]

    def on_submit(self, prompt_tokens: int, max_tokens: int) -> None:
        self.submitted += 1
        self.sum_prompt += prompt_tokens
        self.sum_prompt_A += prefill_A(prompt_tokens, 0)
        self.sum_max_tokens += max_tokens

    def on_cycle(self, seconds: float) -> None:
        self.cycles += 1
        self.sum_cycle_s += seconds

    def on_finish(self, output_tokens: int) -> None:
        self.finished += 1
        self.sum_t_out += output_tokens

    def on_decode(
        self,
        node: str,
        batch: int,
        accepted: int,
        t_fwd: float,
        queued: int,
        duration_s: float,
        iterations: int = 1,
    ) -> None:
        """``iterations`` identical iterations, each of ``duration_s`` with ``accepted`` tokens."""
        m = max(1, iterations)
        self.dec_iters += m
        self.dec_batch += batch * m
        self.dec_accepted += accepted * m
        self.dec_fwd += t_fwd * batch * m
        self.dec_busy_s += duration_s * m
        occ = self.dec_occupancy.setdefault(node, [0.0, 0.0])
        occ[0] += (batch + queued) * duration_s * m
        occ[1] += duration_s * m

    def on_prefill(
        self, t_uc: int, t_c: int, t_rst: int, queued: int, duration_s: float, iterations: int = 1
    ) -> None:
        m = max(1, iterations)
        self.pre_iters += m
        self.pre_t_uc += t_uc * m
        self.pre_t_c += t_c * m
        self.pre_t_rst += t_rst * m
        self.pre_busy_s += duration_s * m
        self.pre_queue += queued * duration_s * m


@dataclass(frozen=True, slots=True)
class Work:
    """Mean work per request ``w_bar`` in one slice, plus the slice's load.

    ``t_uc``, ``t_c``, ``t_rst``, ``t_out``: tokens per request; ``A``: mean query-key pairs
    per request (the mean of A, not A of the means: eq. 1 is linear in A); ``t_acc``: tokens
    accepted per request per decode iteration; ``t_fwd``: tokens fed per request per decode
    iteration; ``q``: mean number of requests in decode (running + waiting, whole cluster);
    ``arrivals_rps``: requests submitted per second; ``prompt``: mean total input length.
    """

    t_uc: float
    t_c: float
    A: float
    t_rst: float
    t_out: float
    t_acc: float
    t_fwd: float
    q: float
    arrivals_rps: float
    prompt: float
    # per-request means of the products of (t_uc, t_c, A): E[t_uc^2], E[t_c^2], E[A^2],
    # E[t_uc A], E[t_uc t_c], E[A t_c]; ``None`` = no spread known (every request is the mean)
    moments: tuple[float, float, float, float, float, float] | None = None
    # mean time between a branch's consecutive submissions (0: none seen), and the mean number
    # of requests waiting for prefill in the whole cluster (time average)
    cycle_s: float = 0.0
    prefill_queue: float = 0.0

    @property
    def context(self) -> float:
        """KV tokens a running decode request holds on average: its prompt and half its output."""
        return self.t_c + self.t_uc + self.t_out / 2.0


def _ratio(num: float, den: float, fallback: float) -> float:
    return num / den if den > 0 else fallback


def work_of(s: SliceStats, window: SliceStats, slice_s: float, default_t_fwd: float) -> Work:
    """``w_bar`` of slice ``s``; a mean the slice cannot give (no request routed, none finished,
    no decode iteration) falls back to the whole window's, then to a neutral default."""
    moments = None
    if window.routed > 0:
        t_uc = _ratio(s.sum_t_uc, s.routed, window.sum_t_uc / window.routed)
        t_c = _ratio(s.sum_t_c, s.routed, window.sum_t_c / window.routed)
        A = _ratio(s.sum_A, s.routed, window.sum_A / window.routed)
        src = s if s.routed > 0 else window
        moments = tuple(
            getattr(src, f) / src.routed
            for f in ("sum_t_uc2", "sum_t_c2", "sum_A2", "sum_uc_A", "sum_uc_c", "sum_A_c")
        )
    else:  # no router view: split the prompt by the cached share the prefill engines saw
        prompt = _ratio(s.sum_prompt, s.submitted, _ratio(window.sum_prompt, window.submitted, 0.0))
        cached = _ratio(window.pre_t_c, window.pre_t_c + window.pre_t_uc, 0.0)
        t_c = prompt * cached
        t_uc = prompt - t_c
        A = prefill_A(t_uc, t_c)
    share_rst = _ratio(s.pre_t_rst, s.pre_t_c, _ratio(window.pre_t_rst, window.pre_t_c, 0.0))
    t_out_w = _ratio(window.sum_t_out, window.finished, _ratio(window.sum_max_tokens, window.submitted, 1.0))
    t_out = _ratio(s.sum_t_out, s.finished, t_out_w)
    t_acc = _ratio(s.dec_accepted, s.dec_batch, _ratio(window.dec_accepted, window.dec_batch, default_t_fwd))
    t_fwd = _ratio(s.dec_fwd, s.dec_batch, _ratio(window.dec_fwd, window.dec_batch, default_t_fwd))
    prompt = _ratio(s.sum_prompt, s.submitted, _ratio(window.sum_prompt, window.submitted, t_uc + t_c))
    return Work(
        t_uc=t_uc,
        t_c=t_c,
        A=A,
        t_rst=share_rst * t_c,
        t_out=max(1.0, t_out),
        t_acc=max(1e-3, t_acc),
        t_fwd=max(1e-3, t_fwd),
        q=s.decode_population(),
        arrivals_rps=s.submitted / slice_s,
        prompt=prompt,
        moments=moments,
        cycle_s=_ratio(s.sum_cycle_s, s.cycles, _ratio(window.sum_cycle_s, window.cycles, 0.0)),
        prefill_queue=s.pre_queue / slice_s,
    )
