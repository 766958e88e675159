"""Baseline planners behind the planner interface (METHOD.md §2 and §5), for comparison.

Pure state machines like ``EvolvingPlanner``: no I/O, no clock; they share its event folding,
warm-up, model fitting and ``ModelFitted`` publication (so a router in charge gets coefficients
whichever planner runs), and differ only in how they pick a split. Each starts from a
configured split (``initial``, e.g. "6P3D", scaled to the node count) ordered at warm-up end.
What each reproduces, and where it is our reading, is in docs/planner.md.

- ``StaticPlanner``: never switches (SGLang PD at a fixed split).
- ``DynamoPlanner``: Dynamo's load-based planner (``components/src/dynamo/planner/core/
  load_scaling.py``, easy mode): every 5 s, prefill asks +1/-1 on queued prefill tokens /
  context length, decode on KV utilisation; on a fixed cluster (a full GPU budget) a node
  moves, by restart, only on an opposing rebalance; nothing while a switch is in progress.
- ``ArrowPlanner``: Arrow's instance scheduling (arXiv 2505.11916) as we read it: predicted
  TTFT from total input length (cached prefix counted as new work) over its SLO flips a decode
  node to prefill, measured TPOT over its SLO flips a prefill node to decode, in place but
  dropping the node's KV.
"""

from __future__ import annotations

import math
import re
from typing import Literal

import msgspec

from events.catalog import (
    Event,
    FirstToken,
    IterationDone,
    PlanEvaluated,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
    Split,
    Tick,
)
from events.ids import SwitchMechanism
from services.cores.planner.base import _ENC, NEWCOMERS, REPAIR, BaseConfig, PlannerBase
from services.cores.planner.window import SliceStats


def parse_split(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*P\s*(\d+)\s*D\s*", text, flags=re.IGNORECASE)
    assert m, f"a split is written like '6P3D', got {text!r}"
    return int(m.group(1)), int(m.group(2))


def scale_split(text: str, n: int) -> int:
    """Prefill nodes of split ``text`` scaled to ``n`` nodes (rounded half up, 1..n-1)."""
    p, d = parse_split(text)
    return min(max(1, math.floor(n * p / max(1, p + d) + 0.5)), max(1, n - 1))


class BaselineConfig(BaseConfig, kw_only=True, forbid_unknown_fields=True):
    initial: str = "6P3D"


class _Baseline(PlannerBase):
    Config = BaselineConfig

    def _event(self, ts: float, k_end: int, **kw) -> PlanEvaluated:
        cfg = self.cfg
        return PlanEvaluated(
            ts=ts,
            src=self.name,
            window_start=(k_end - cfg.slices) * cfg.slice_s,
            window_end=k_end * cfg.slice_s,
            current=self.current_split(),
            planner=self.name,
            **kw,
        )

    def _switch_to(self, ts: float, k_end: int, P: int, reason: str) -> list[Event]:
        N = len(self.st.nodes)
        chosen = Split(prefill=P, decode=N - P)
        return [
            self._event(ts, k_end, chosen=chosen, reason=reason),
            *self.order(self.nodes_to_switch(P), ts, reason),
        ]

    def _on_warmup_end(self, ts: float, k_end: int) -> list[Event]:
        N = len(self.st.nodes)
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        return self._switch_to(
            ts, k_end, scale_split(self.cfg.initial, N), f"initial split {self.cfg.initial}"
        )

    def _ungated(self, ts: float, k_end: int, target_prefill: int, why: str) -> list[Event] | None:
        """The NEWCOMERS placement (toward ``target_prefill`` prefill nodes, moving no assigned
        node) or the 0P/0D REPAIR (one node) when the guard state asks for one; None when the
        planner's own rule decides."""
        path = self.guard()
        if path == NEWCOMERS:
            chosen, reason, orders = self.place_newcomers(ts, target_prefill, why)
        elif path == REPAIR:
            chosen, reason, orders = self.repair(ts)
        else:
            return None
        return [self._event(ts, k_end, chosen=chosen, reason=reason), *orders]


class StaticConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "static"


class StaticPlanner(_Baseline):
    Config = StaticConfig
    name = "static"

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        N = len(self.st.nodes)
        ungated = None
        if N >= 2:  # a node joined after warm-up: toward the configured ratio
            ungated = self._ungated(ts, k_end, scale_split(self.cfg.initial, N), f"static {self.cfg.initial}")
        return ungated or [self._event(ts, k_end, reason="static: never switches")]


# --------------------------------------------------------------------------- load signals
class _Req(msgspec.Struct, array_like=True):
    """One in-flight request the load tracker follows."""

    prompt: int = 0
    out: int = 0
    t_uc: int = 0
    prefill: str = ""  # queued on this prefill node, until RequestStarted(prefill)
    decode_plan: str = ""  # the router's decode node
    decode: str = ""  # its KV is on (or on its way to) this decode node: FirstToken .. finish


class _Load(msgspec.Struct):
    """Per-node load, built from the request events (the numbers an engine's forward-pass
    metrics report), and the per-node samples of the current adjustment interval."""

    reqs: dict[str, _Req] = {}
    queued_new: dict[str, float] = {}  # prefill node -> queued new (uncached) prompt tokens
    queued_total: dict[str, float] = {}  # prefill node -> queued prompt tokens, cached prefix included
    queued_pairs: dict[str, float] = {}  # prefill node -> sum of prompt*(prompt+1)/2 (t_c = 0)
    decode_kv: dict[str, float] = {}  # decode node -> KV tokens of its running and waiting requests
    samples: dict[str, list[float]] = {}  # "metric|node" -> [sum, n] over the interval's ticks
    tpot: list[float] = msgspec.field(
        default_factory=lambda: [0.0, 0.0]
    )  # decode: [sum of iteration seconds, sum of tokens per request]


def _add(d: dict[str, float], k: str, v: float) -> None:
    x = d.get(k, 0.0) + v
    if abs(x) < 1e-6:
        d.pop(k, None)
    else:
        d[k] = x


class _Tracked(_Baseline):
    """A baseline whose rule reads per-node load signals. They come from the request events
    every engine publishes (``RequestSubmitted``, ``RouteDecided``, ``RequestStarted``,
    ``FirstToken``, ``RequestFinished``, ``IterationDone``), so the same rule runs in the
    simulator (which sends no heartbeats) and on a live cluster. Each ``Tick`` after warm-up
    takes one sample per node; a decision reads the mean of its interval's samples (Dynamo's
    ``load_metric_samples`` per ``load_adjustment_interval``). The tracker's state travels in
    the snapshot next to the base state."""

    def __init__(self, **config) -> None:
        super().__init__(**config)
        self.load = _Load()

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> bytes:
        return _ENC.encode((super().snapshot(), _ENC.encode(self.load)))

    @classmethod
    def from_snapshot(cls, data: bytes):
        try:
            base, load = msgspec.msgpack.decode(data, type=tuple[bytes, bytes])
        except msgspec.ValidationError:  # not ours: the base says whose it is
            return super().from_snapshot(data)
        self = super().from_snapshot(base)
        self.load = msgspec.msgpack.decode(load, type=_Load)
        return self

    # ------------------------------------------------------------------ folding
    def apply(self, event: Event) -> list[Event]:
        t = type(event)
        if t is Tick:
            if self.st.frozen:
                self._sample()
        elif t is RequestSubmitted:
            self.load.reqs[event.request] = _Req(prompt=event.prompt_tokens, out=event.max_tokens)
        elif t is RouteDecided:
            self._routed(event)
        elif t is RequestStarted:
            self._started(event)
        elif t is FirstToken:
            self._first_token(event)
        elif t is RequestFinished:
            self._finished(event)
        elif t is IterationDone and event.phase == "decode" and event.batch > 0 and event.accepted_tokens > 0:
            n = self.st.nodes.get(event.node)
            if n is not None and n.target == "decode":
                it = max(1, event.iterations)
                self.load.tpot[0] += event.duration_s * it
                self.load.tpot[1] += event.accepted_tokens / event.batch * it
        return super().apply(event)

    def _routed(self, ev: RouteDecided) -> None:
        r = self.load.reqs.get(ev.request)
        if ev.shadow or r is None or r.decode:
            return
        self._unqueue(r)
        r.prefill, r.t_uc, r.decode_plan = ev.prefill_node, ev.t_uc, ev.decode_node
        L = self.load
        _add(L.queued_new, r.prefill, r.t_uc)
        _add(L.queued_total, r.prefill, r.prompt)
        _add(L.queued_pairs, r.prefill, r.prompt * (r.prompt + 1) / 2)

    def _unqueue(self, r: _Req) -> None:
        if r.prefill:
            L = self.load
            _add(L.queued_new, r.prefill, -r.t_uc)
            _add(L.queued_total, r.prefill, -r.prompt)
            _add(L.queued_pairs, r.prefill, -r.prompt * (r.prompt + 1) / 2)
            r.prefill = ""

    def _kv(self, r: _Req) -> float:
        """KV tokens a request holds in decode: its prompt plus half its output (the mean
        over its decode, as the context grows)."""
        return r.prompt + r.out / 2

    def _started(self, ev: RequestStarted) -> None:
        r = self.load.reqs.get(ev.request)
        if r is None:
            return
        if ev.phase == "prefill":
            self._unqueue(r)
        elif ev.phase == "decode" and r.decode and r.decode != ev.node:
            _add(self.load.decode_kv, r.decode, -self._kv(r))
            r.decode = ev.node
            _add(self.load.decode_kv, r.decode, self._kv(r))

    def _first_token(self, ev: FirstToken) -> None:
        r = self.load.reqs.get(ev.request)
        if r is None or r.decode:
            return
        self._unqueue(r)
        r.decode = r.decode_plan or ev.node
        _add(self.load.decode_kv, r.decode, self._kv(r))

    def _finished(self, ev: RequestFinished) -> None:
        r = self.load.reqs.pop(ev.request, None)
        if r is None:
            return
        self._unqueue(r)
        if r.decode:
            _add(self.load.decode_kv, r.decode, -self._kv(r))

    # ------------------------------------------------------------------ samples
    def _sample(self) -> None:
        L = self.load
        for name in sorted(self.st.nodes):
            n = self.st.nodes[name]
            if n.role == "prefill" and not n.ordered:
                self._push(f"qnew|{name}", L.queued_new.get(name, 0.0))
                self._push(f"qtot|{name}", L.queued_total.get(name, 0.0))
                self._push(f"qpairs|{name}", L.queued_pairs.get(name, 0.0))
            elif n.role == "decode" and not n.ordered:
                self._push(f"kv|{name}", L.decode_kv.get(name, 0.0))

    def _push(self, key: str, v: float) -> None:
        s = self.load.samples.setdefault(key, [0.0, 0.0])
        s[0] += v
        s[1] += 1

    def mean_signal(self, metric: str, node: str) -> float:
        """The interval's mean of ``metric`` on ``node`` (its current value without samples)."""
        s = self.load.samples.get(f"{metric}|{node}")
        if s and s[1] > 0:
            return s[0] / s[1]
        cur = {
            "qnew": self.load.queued_new,
            "qtot": self.load.queued_total,
            "qpairs": self.load.queued_pairs,
            "kv": self.load.decode_kv,
        }[metric]
        return cur.get(node, 0.0)

    def interval_tpot_s(self) -> float | None:
        sec, tok = self.load.tpot
        return sec / tok if tok > 0 else None

    def _reset_interval(self) -> None:
        self.load.samples = {}
        self.load.tpot = [0.0, 0.0]

    def serving(self, role: str) -> list[str]:
        return [n for n in sorted(self.st.nodes) if self.st.nodes[n].target == role]

    def _one_node(self, ts: float, k_end: int, to_role: str, why: str) -> list[Event]:
        """Move the least-loss node of the other side to ``to_role`` (one node per decision)."""
        cur = self.current_split()
        P = cur.prefill + (1 if to_role == "prefill" else -1)
        return self._switch_to(
            ts,
            k_end,
            P,
            f"one node {'decode -> prefill' if to_role == 'prefill' else 'prefill -> decode'}; {why}",
        )

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        try:
            return self._decide(ts, k_end)
        finally:
            self._reset_interval()

    def _decide(self, ts: float, k_end: int) -> list[Event]:
        raise NotImplementedError


# --------------------------------------------------------------------------- Dynamo
#: Dynamo planner's "easy mode" static thresholds (components/src/dynamo/planner/core/
#: load_scaling.py): prefill on queued prefill tokens / context length, decode on KV
#: utilisation (scheduled + queued decode KV) / max KV tokens. (up, down) per target.
DYNAMO_THRESHOLDS: dict[str, dict[str, tuple[float, float]]] = {
    "throughput": {"prefill": (1.0, 0.1), "decode": (1.0, 0.6)},
    "latency": {"prefill": (0.1, 0.0), "decode": (0.4, 0.1)},
}


class DynamoConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "dynamo"
    window_s: float = 5.0  # Dynamo's load_adjustment_interval (s)
    slices: int = 2
    mechanism: SwitchMechanism = "restart"
    optimization_target: Literal["throughput", "latency"] = "throughput"  # Dynamo's default
    context_length: int = 200_000  # the served model's context length (prefill ratio denominator)
    min_endpoint: int = 1  # Dynamo's min_endpoint, per phase


class DynamoPlanner(_Tracked):
    """Dynamo's load-based planner in disaggregated mode on a fixed cluster.

    Every ``window_s`` (Dynamo's ``load_adjustment_interval``, 5 s), unless a switch is in
    progress (Dynamo observes only while scaling): prefill asks +1 when ANY prefill node's
    mean queued new prefill tokens / ``context_length`` reaches the up threshold, -1 when ALL
    are under the down threshold (latency target: all queues empty); decode asks +1 when ANY
    decode node's KV utilisation (its running and waiting requests' KV / GPU KV capacity)
    exceeds the up threshold, -1 when ALL are under the down threshold. A fixed cluster is
    Dynamo at a full GPU budget (min = max = N): a scale-up is admitted only as an opposing
    rebalance (one phase +1 while the other asks -1), so a node moves, by restart, only then.
    """

    Config = DynamoConfig
    name = "dynamo"

    def wants(self) -> tuple[int, int, str]:
        """(prefill want, decode want, signals): each -1, 0 or +1."""
        cfg = self.cfg
        th = DYNAMO_THRESHOLDS[cfg.optimization_target]
        pre, dec = self.serving("prefill"), self.serving("decode")
        ratios = [self.mean_signal("qnew", n) / max(1, cfg.context_length) for n in pre]
        utils = [
            self.mean_signal("kv", n) / self.st.nodes[n].l1_capacity
            for n in dec
            if self.st.nodes[n].l1_capacity > 0
        ]
        p_up, p_down = th["prefill"]
        d_up, d_down = th["decode"]
        want_p = 0
        if ratios and max(ratios) >= p_up:
            want_p = 1
        elif (
            len(pre) > cfg.min_endpoint
            and ratios
            and all((r <= p_down if cfg.optimization_target == "latency" else r < p_down) for r in ratios)
        ):
            want_p = -1
        want_d = 0
        if utils and max(utils) > d_up:
            want_d = 1
        elif len(dec) > cfg.min_endpoint and utils and all(u < d_down for u in utils):
            want_d = -1
        sig = (
            f"prefill queue/ctx max {max(ratios, default=0.0):.3f} (up {p_up:g}, down {p_down:g}), "
            f"decode kv util max {max(utils, default=0.0):.2f} min {min(utils, default=0.0):.2f} "
            f"(up {d_up:g}, down {d_down:g})"
        )
        return want_p, want_d, sig

    def _decide(self, ts: float, k_end: int) -> list[Event]:
        cur = self.current_split()
        N = len(self.st.nodes)
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        # a node joined after warm-up: it serves decode, the prefill count stays
        ungated = self._ungated(ts, k_end, cur.prefill, "dynamo: the prefill count stays")
        if ungated:
            return ungated
        want_p, want_d, sig = self.wants()
        if any(n.ordered for n in self.st.nodes.values()):
            return [self._event(ts, k_end, reason=f"switch in progress, observing only; {sig}")]
        if want_p > 0 and want_d < 0:
            return self._one_node(ts, k_end, "prefill", f"prefill +1, decode -1; {sig}")
        if want_d > 0 and want_p < 0:
            return self._one_node(ts, k_end, "decode", f"decode +1, prefill -1; {sig}")
        if want_p > 0 or want_d > 0:
            return [self._event(ts, k_end, reason=f"held by the full GPU budget (no donor); {sig}")]
        return [self._event(ts, k_end, reason=f"no scale-up; {sig}")]


# --------------------------------------------------------------------------- Arrow
class ArrowConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "arrow"
    window_s: float = 10.0  # how often the instance scheduler looks (our choice)
    slices: int = 2
    mechanism: SwitchMechanism = "in_place_drop_kv"
    ttft_slo_s: float = 5.0
    tpot_slo_s: float = 0.05


class ArrowPlanner(_Tracked):
    """Arrow's adaptive instance scheduling (Wu et al., arXiv 2505.11916), as we read it.

    Every ``window_s``: the predicted TTFT of a new request is the best prefill node's
    queued prompts plus the mean prompt, costed from *total input length* (eq. 1 with
    t_c = 0: cached prefix counted as new work, METHOD §2.2); the decode TPOT is the
    interval's measured decode seconds per output token. Predicted TTFT over ``ttft_slo_s``
    flips one decode node to prefill if the remaining decode nodes keep TPOT within
    ``tpot_slo_s`` (TPOT x D/(D-1)); TPOT over the SLO flips one prefill node to decode if
    the remaining prefill nodes keep the predicted TTFT within its SLO. Flips are in place
    and drop the node's KV; no cooldown (Arrow reacts at once: the paper's 34 switches).
    """

    Config = ArrowConfig
    name = "arrow"

    def _cost(self, tokens: float, pairs: float) -> float:
        """Node-seconds eq. 1 charges ``tokens`` new tokens with ``pairs`` query-key pairs,
        averaged over the nodes' fitted models."""
        models = [self.prefill_model(n) for n in sorted(self.st.nodes)] or [self.prefill_model("")]
        c = [sum(m.coefficients[i] for m in models) / len(models) for i in range(4)]
        budget = sum(n.token_budget for n in self.st.nodes.values()) / max(1, len(self.st.nodes)) or 16384
        return c[0] * math.ceil(max(1.0, tokens) / budget) + c[1] * tokens + c[2] * pairs

    def predicted_prefill_s(self, stats: SliceStats) -> float:
        """Node-seconds of prefill Arrow predicts for the requests submitted in ``stats``:
        the whole prompt counted as new tokens (t_c = 0)."""
        return self._cost(stats.sum_prompt, stats.sum_prompt_A)

    def predicted_ttft_s(self, k_end: int, extra_share: float = 1.0) -> float | None:
        """Predicted TTFT of the interval's mean request on the best prefill node, its queue
        scaled by ``extra_share`` (P/(P-1) if a prefill node left). None without prompts."""
        pre = self.serving("prefill")
        stats = SliceStats()
        for s in self.window_slices(k_end):
            stats.add(s)
        n_sub = stats.submitted
        if not pre or n_sub == 0:
            return None
        mean_prompt = stats.sum_prompt / n_sub
        own = self._cost(mean_prompt, mean_prompt * (mean_prompt + 1) / 2)
        waits = [
            self._cost(self.mean_signal("qtot", n) * extra_share, self.mean_signal("qpairs", n) * extra_share)
            if self.mean_signal("qtot", n) > 0
            else 0.0
            for n in pre
        ]
        return min(waits) + own

    def _decide(self, ts: float, k_end: int) -> list[Event]:
        cfg = self.cfg
        N = len(self.st.nodes)
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        cur = self.current_split()
        ungated = self._ungated(ts, k_end, max(1, cur.prefill), "arrow: the prefill count stays")
        if ungated:
            return ungated
        P, D = cur.prefill, cur.decode
        ttft = self.predicted_ttft_s(k_end)
        tpot = self.interval_tpot_s()
        sig = (
            f"predicted ttft {'-' if ttft is None else f'{ttft:.2f}'} s (slo {cfg.ttft_slo_s:g}), "
            f"tpot {'-' if tpot is None else f'{1000 * tpot:.1f}'} ms (slo {1000 * cfg.tpot_slo_s:g})"
        )
        if ttft is not None and ttft > cfg.ttft_slo_s and D > 1:
            if tpot is None or tpot * D / (D - 1) <= cfg.tpot_slo_s:
                return self._one_node(ts, k_end, "prefill", f"ttft over slo; {sig}")
            return [self._event(ts, k_end, reason=f"ttft over slo, no decode node to spare; {sig}")]
        if tpot is not None and tpot > cfg.tpot_slo_s and P > 1:
            after = self.predicted_ttft_s(k_end, P / (P - 1))
            if after is None or after <= cfg.ttft_slo_s:
                return self._one_node(ts, k_end, "decode", f"tpot over slo; {sig}")
            return [self._event(ts, k_end, reason=f"tpot over slo, no prefill node to spare; {sig}")]
        return [self._event(ts, k_end, reason=f"within slo; {sig}")]
