"""An engine worker's Prometheus metrics (``/metrics`` on ``--metrics-port``, docs/live.md).

One registry per worker (several workers share a process in tests). Every metric carries
``node``. The gauges are read when scraped, from what the worker already knows: the backend's
load (the numbers its heartbeat reports) and the worker's own directory view; the counters
follow the events the node emits (:meth:`EngineMetrics.observe`, called for each of them
before it is published). Gauge names follow SGLang's where one exists
(``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` -> ``ei_engine_num_running_reqs`` /
``ei_engine_num_queue_reqs``), counters SGLang's ``*_tokens_total``.

======================================  =======  ===========================================
metric                                  type     meaning
======================================  =======  ===========================================
``ei_engine_num_running_reqs``          gauge    requests running on the node (heartbeat's)
``ei_engine_num_queue_reqs``            gauge    requests queued on the node (heartbeat's)
``ei_engine_kv_used_tokens{tier}``      gauge    KV tokens held in ``L1`` (GPU) / ``L2`` (host)
``ei_engine_kv_blocks{tier}``           gauge    KV blocks the worker's directory view says
                                                 the node holds in ``tier``
``ei_engine_role{role}``                gauge    1 for the node's current role, 0 for others
``ei_engine_iterations_total{phase}``   counter  ``IterationDone`` by phase
``ei_engine_iteration_seconds_total``   counter  their ``duration_s`` summed, by phase
``ei_engine_requests_started_total``    counter  ``RequestStarted`` by phase
``ei_engine_requests_finished_total``   counter  ``RequestFinished`` by status (ok|error)
``ei_engine_prompt_tokens_total``       counter  prompt tokens the node prefilled, cached
                                                 ones included (``RequestStarted`` prefill:
                                                 the request's prompt length)
``ei_engine_cached_tokens_total``       counter  of those, reused from cache
                                                 (``RequestStarted.cached_tokens``)
``ei_engine_generation_tokens_total``   counter  output tokens of finished requests
``ei_engine_events_total{type}``        counter  events the node emitted, by type
``ei_engine_kv_event_anomalies_total``  counter  a server's KV events the backend could not
``{kind}``                                       fold or had to drop its view for (attached
                                                 backends that count them: vLLM's
                                                 ``orphan_pages``, ``unknown_removed``,
                                                 ``sequence_gaps``, ``resync_<why>``)
``ei_engine_cached_tokens_vs_server``   counter  requests whose predicted cached prefix
``_total{outcome}``                              (the node's view) agree or
                                                 disagree with the server's reported
                                                 ``cached_tokens`` (vLLM)
``ei_engine_cached_tokens_vs_server``   counter  the absolute differences, tokens, summed
``_diff_tokens_total``
======================================  =======  ===========================================
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.backend import NodeLoad
from events.catalog import Event, IterationDone, RequestFinished, RequestStarted

ROLES = ("collocated", "prefill", "decode")
TIERS = ("L1", "L2")


class _Gauges(Collector):
    """The scrape-time gauges: one ``load()`` per scrape."""

    def __init__(self, node: str, load: Callable[[], NodeLoad], kv_blocks: Callable[[str], int],
                 kv_event_counts: Callable[[], dict[str, int]] | None = None,
                 cached_vs_server: Callable[[], dict[str, int]] | None = None) -> None:
        self.node, self.load, self.kv_blocks, self.kv_event_counts = node, load, kv_blocks, kv_event_counts
        self.cached_vs_server = cached_vs_server

    def collect(self):
        ld = self.load()
        n = self.node
        running = GaugeMetricFamily("ei_engine_num_running_reqs", "requests running on the node", labels=["node"])
        running.add_metric([n], ld.running)
        queued = GaugeMetricFamily("ei_engine_num_queue_reqs", "requests queued on the node", labels=["node"])
        queued.add_metric([n], ld.queued)
        used = GaugeMetricFamily("ei_engine_kv_used_tokens", "KV tokens held, by tier (L1 GPU, L2 host)",
                                 labels=["node", "tier"])
        used.add_metric([n, "L1"], ld.l1_used_tokens)
        used.add_metric([n, "L2"], ld.l2_used_tokens)
        blocks = GaugeMetricFamily("ei_engine_kv_blocks", "KV blocks the worker's directory view holds for the "
                                   "node, by tier", labels=["node", "tier"])
        for tier in TIERS:
            blocks.add_metric([n, tier], self.kv_blocks(tier))
        role = GaugeMetricFamily("ei_engine_role", "1 for the node's current role", labels=["node", "role"])
        for r in ROLES:
            role.add_metric([n, r], 1.0 if ld.role == r else 0.0)
        yield from (running, queued, used, blocks, role)
        if self.kv_event_counts is not None:
            bad = CounterMetricFamily("ei_engine_kv_event_anomalies", "a server's KV events not folded, or the view "
                                      "dropped, by kind", labels=["node", "kind"])
            for kind, count in sorted(self.kv_event_counts().items()):
                bad.add_metric([n, kind], count)
            yield bad
        if self.cached_vs_server is not None:
            got = self.cached_vs_server()
            vs = CounterMetricFamily("ei_engine_cached_tokens_vs_server", "requests whose predicted cached prefix "
                                     "agrees with the server's reported cached_tokens, or not", labels=["node", "outcome"])
            for outcome in ("agree", "disagree"):
                vs.add_metric([n, outcome], got.get(outcome, 0))
            diff = CounterMetricFamily("ei_engine_cached_tokens_vs_server_diff_tokens", "absolute differences between "
                                       "predicted and reported cached tokens, summed", labels=["node"])
            diff.add_metric([n], got.get("diff_tokens", 0))
            yield from (vs, diff)


class EngineMetrics:
    """The metrics of one engine worker, in a registry of its own. ``service`` names it in
    the metrics server's log line (services/adapters/metrics.py, ``MetricsServer``)."""

    def __init__(self, node: str, load: Callable[[], NodeLoad], kv_blocks: Callable[[str], int],
                 kv_event_counts: Callable[[], dict[str, int]] | None = None,
                 cached_vs_server: Callable[[], dict[str, int]] | None = None) -> None:
        self.node = node
        self.service = f"engine-{node}"
        self.registry = r = CollectorRegistry()
        r.register(_Gauges(node, load, kv_blocks, kv_event_counts, cached_vs_server))
        lab = ["node"]
        self.iterations = Counter("ei_engine_iterations", "IterationDone by phase", lab + ["phase"], registry=r)
        self.iteration_s = Counter("ei_engine_iteration_seconds", "IterationDone duration_s summed, by phase",
                                   lab + ["phase"], registry=r)
        self.started = Counter("ei_engine_requests_started", "RequestStarted by phase", lab + ["phase"], registry=r)
        self.finished = Counter("ei_engine_requests_finished", "RequestFinished by status (ok|error)",
                                lab + ["status"], registry=r)
        self.prompt = Counter("ei_engine_prompt_tokens", "prompt tokens prefilled (cached ones included)", lab,
                              registry=r)
        self.cached = Counter("ei_engine_cached_tokens", "prompt tokens reused from cache", lab, registry=r)
        self.generated = Counter("ei_engine_generation_tokens", "output tokens of finished requests", lab,
                                 registry=r)
        self.events = Counter("ei_engine_events", "events the node emitted, by type", lab + ["type"], registry=r)
        # the worker's stream input (engine/worker/stream.py): how far it folded, how far behind
        # the stream's head, and what it would not fold (a consumer that silently stopped)
        self.applied = Gauge("ei_engine_applied_seq", "last stream sequence folded into the worker's view", lab,
                             registry=r)
        self.lag = Gauge("ei_engine_consumer_lag_events", "stream head minus the last sequence folded", lab,
                         registry=r)
        self.dead_letters = Counter("ei_engine_dead_letters", "deliveries dead-lettered (undecodable or refused)",
                                    lab, registry=r)
        self.dead_letter_failed = Counter("ei_engine_dead_letters_failed",
                                          "dead letters the bus did not take (logged whole instead)", lab, registry=r)
        self.refused = Counter("ei_engine_events_refused", "events the authority rule refused (events/authority.py)",
                               lab, registry=r)
        self.fold_failed = Counter("ei_engine_fold_failures", "deliveries whose fold raised (logged, skipped)", lab,
                                   registry=r)
        for c in (self.prompt, self.cached, self.generated, self.applied, self.lag, self.dead_letters,
                  self.dead_letter_failed, self.refused, self.fold_failed):
            c.labels(node)  # export zeros from the start
        for phase in ("prefill", "decode"):
            self.iterations.labels(node, phase)
            self.started.labels(node, phase)

    def observe(self, event: Event, prompt_tokens: int = 0) -> None:
        """One event the node emitted (``prompt_tokens``: the request's, for a prefill start)."""
        n, t = self.node, type(event)
        self.events.labels(n, t.__name__).inc()
        if t is IterationDone:
            self.iterations.labels(n, event.phase).inc()
            self.iteration_s.labels(n, event.phase).inc(max(0.0, event.duration_s))
        elif t is RequestStarted and event.node == n:
            self.started.labels(n, event.phase).inc()
            if event.phase == "prefill":
                self.prompt.labels(n).inc(max(prompt_tokens, event.cached_tokens))
                self.cached.labels(n).inc(event.cached_tokens)
        elif t is RequestFinished:
            self.finished.labels(n, "error" if event.error else "ok").inc()
            self.generated.labels(n).inc(event.output_tokens)

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (tests)."""
        return float(self.registry.get_sample_value(name, {"node": self.node, **labels}) or 0.0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
