"""Per-node load signals folded from the request events, for the baselines whose rule reads
them (Dynamo, Arrow).

Pure state machine like ``EvolvingPlanner`` (no I/O, no clock); what it reproduces and where it is
our reading: docs/planner.md, "Baselines".
"""

from __future__ import annotations

import msgspec

from events.catalog import (
    Event,
    FirstToken,
    IterationDone,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
    Tick,
)
from services.cores.planner.base import SNAPSHOT_ENCODER
from services.cores.planner.configured import BaselinePlanner


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


class LoadTrackingPlanner(BaselinePlanner):
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
        return SNAPSHOT_ENCODER.encode((super().snapshot(), SNAPSHOT_ENCODER.encode(self.load)))

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
        match event:
            case IterationDone() if event.phase == "decode" and event.batch > 0 and event.accepted_tokens > 0:
                n = self.st.nodes.get(event.node)
                if n is not None and n.target == "decode":
                    it = max(1, event.iterations)
                    self.load.tpot[0] += event.duration_s * it
                    self.load.tpot[1] += event.accepted_tokens / event.batch * it
            case RequestSubmitted():
                self.load.reqs[event.request] = _Req(prompt=event.prompt_tokens, out=event.expected_output_tokens())
            case RouteDecided():
                self._routed(event)
            case RequestStarted():
                self._started(event)
            case FirstToken():
                self._first_token(event)
            case RequestFinished():
                self._finished(event)
            case Tick() if self.st.frozen:
                self._sample()
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
