"""The gateway's Prometheus metrics (prometheus_client, one private registry per app, so
several gateways can live in one process, as they do in tests).

Counters: ``ei_gateway_requests_total{endpoint}``, ``ei_gateway_headerless_requests_total``,
``ei_gateway_errors_total{status,code}``, ``ei_gateway_compactions_total{reason}``,
``ei_gateway_branches_opened_total``, ``ei_gateway_branches_ended_total``,
``ei_gateway_output_tokens_total``, ``ei_gateway_route_timeouts_total``,
``ei_gateway_branches_expired_total``, ``ei_gateway_unknown_agent_hints_total``,
``ei_gateway_ignored_fields_total{api,field}``, ``ei_gateway_conversations_continued_total``.
Gauges (read when scraped): ``ei_gateway_open_branches``, ``ei_gateway_in_flight_requests``.

The metrics people already graph (docs/gateway.md, "Metrics": the table that maps them to
Dynamo's and SGLang's) are Dynamo's frontend metrics with the prefix ``ei_frontend_`` instead
of ``dynamo_frontend_``: the same suffixes, the ``model`` label, the same log-spaced buckets
(:func:`log_buckets`, Dynamo's ``generate_log_buckets`` with its default ranges), observed the
same way (:class:`RequestObserver`, after Dynamo's ``ResponseMetricCollector``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ei_gateway_requests_total": ("completion requests received, by endpoint", ("endpoint",)),
    "ei_gateway_headerless_requests_total": ("requests without branch headers (one-request branches)", ()),
    "ei_gateway_errors_total": ("requests answered with an error, by HTTP status and error code",
                                ("status", "code")),
    "ei_gateway_compactions_total": ("ContextCompacted published, by reason (header|inferred)", ("reason",)),
    "ei_gateway_side_requests_total": ("requests served on a side branch of their session (branches.is_side)", ()),
    "ei_gateway_branches_opened_total": ("BranchOpened published", ()),
    "ei_gateway_branches_ended_total": ("BranchEnded published", ()),
    "ei_gateway_output_tokens_total": ("output tokens relayed to clients", ()),
    "ei_gateway_route_timeouts_total": ("requests with no RouteDecided in time", ()),
    "ei_gateway_branches_expired_total": ("BranchEnded(reason=idle) published (idle past --branch-ttl-s)", ()),
    "ei_gateway_unknown_agent_hints_total": ("nvext.agent_hints entries not known here (ignored)", ()),
    "ei_gateway_prompt_bytes_total": ("bytes of token ids put into the prompt store", ()),
    "ei_gateway_ignored_fields_total": ("request fields (and anthropic-beta values) ignored, by API and name",
                                        ("api", "field")),
    "ei_gateway_conversations_continued_total": ("headerless chat requests that continued a branch", ()),
}
CONTENT_TYPE = CONTENT_TYPE_LATEST


def _sig2(x: float) -> float:
    """``x`` rounded to 2 significant figures (Dynamo's ``round_to_sig_figs(x, 2)``)."""
    if x == 0:
        return 0.0
    scale = 10.0 ** (1 - math.floor(math.log10(abs(x))))
    return round(x * scale) / scale


def log_buckets(lo: float, hi: float, count: int) -> tuple[float, ...]:
    """Dynamo's ``generate_log_buckets``: 0, then ``count - 1`` log-spaced bounds from above
    ``lo`` up to ``hi``, each rounded to 2 significant figures, duplicates dropped."""
    out = [0.0]
    for i in range(1, count):
        v = _sig2(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (count - 1)))
        if v != out[-1]:
            out.append(v)
    return tuple(out)


# Dynamo's default ranges (lib/llm/src/http/service/metrics.rs, DYN_METRICS_*_{MIN,MAX,COUNT}).
BUCKETS = {
    "request_duration_seconds": log_buckets(1.0, 512.0, 10),
    "time_to_first_token_seconds": log_buckets(0.001, 480.0, 18),
    "inter_token_latency_seconds": log_buckets(0.001, 2.0, 13),
    "input_sequence_tokens": log_buckets(50.0, 128_000.0, 12),
    "output_sequence_tokens": log_buckets(50.0, 32_000.0, 10),
    "cached_tokens": log_buckets(50.0, 128_000.0, 12),  # Dynamo: the input sequence's buckets
}
FRONTEND = "ei_frontend_"
#: histogram suffix -> help
HISTOGRAMS = {
    "request_duration_seconds": "wall seconds from admission to the response's end (successful requests)",
    "time_to_first_token_seconds": "wall seconds from admission to the first token relayed",
    "inter_token_latency_seconds": "wall seconds between relayed tokens (n tokens at once: n samples of gap / n)",
    "input_sequence_tokens": "prompt tokens per request (observed at the first token)",
    "output_sequence_tokens": "output tokens per successful request",
    "cached_tokens": "prompt tokens per request whose KV the engine reused (else the router's plan)",
}
#: counter name (without _total) -> (help, labels beyond model)
FRONTEND_COUNTERS = {
    "requests": ("completion requests answered, by endpoint, request_type (stream|unary), status (success|error)",
                 ("endpoint", "request_type", "status")),
    "input_tokens": ("prompt tokens of requests that got a first token", ()),
    "cached_input_tokens": ("prompt tokens of those requests whose KV was reused (cached_tokens in usage)", ()),
    "output_tokens": ("output tokens relayed to clients, as they are relayed", ()),
}


class GatewayMetrics:
    def __init__(self, open_branches: Callable[[], float], in_flight: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self._c: dict[str, Counter] = {}
        for name, (help_, labels) in COUNTERS.items():
            self._c[name] = Counter(name.removesuffix("_total"), help_, labels, registry=self.registry)
        for endpoint in ("chat", "completions"):
            self._c["ei_gateway_requests_total"].labels(endpoint=endpoint)
        for reason in ("header", "inferred"):
            self._c["ei_gateway_compactions_total"].labels(reason=reason)
        Gauge("ei_gateway_open_branches", "open branches this gateway remembers",
              registry=self.registry).set_function(open_branches)
        Gauge("ei_gateway_in_flight_requests", "requests being served",
              registry=self.registry).set_function(in_flight)
        r = self.registry
        self.hist = {k: Histogram(FRONTEND + k, h, ["model"], buckets=BUCKETS[k], registry=r)
                     for k, h in HISTOGRAMS.items()}
        self.count = {k: Counter(FRONTEND + k, h, ["model", *labels], registry=r)
                      for k, (h, labels) in FRONTEND_COUNTERS.items()}
        self.inflight = Gauge(FRONTEND + "inflight_requests",
                              "requests from admission until the response ends", ["model"], registry=r)
        self.queued = Gauge(FRONTEND + "queued_requests",
                            "requests from admission until their first token (or their end)", ["model"], registry=r)

    def watch_consumers(self, report: Callable[[], dict], watches: Callable[[], list]) -> None:
        """Export, at scrape time, each stream consumer's pending messages and state as JetStream
        sees it (consumers.py ``ConsumerHealth.report``) and the gateway's own readers' refusals."""
        self.registry.register(_ConsumerGauges(report, watches))

    def request(self, model: str, endpoint: str, stream: bool) -> RequestObserver:
        """Start observing one completion request (``endpoint``: Dynamo's label value)."""
        return RequestObserver(self, model, endpoint, stream)

    def inc(self, name: str, n: float = 1, **labels: str) -> None:
        c = self._c[name]
        (c.labels(**labels) if labels else c).inc(n)

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (tests, status lines)."""
        total = 0.0
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestObserver:
    """One request's frontend metrics (Dynamo's ``ResponseMetricCollector`` + its guards):
    queued and in flight from :meth:`GatewayMetrics.request` on; :meth:`tokens` for each
    relayed message (the first one: TTFT, input and cached tokens, out of the queue; later ones:
    inter-token latency); :meth:`finish` once (duration, output length, the request count)."""

    def __init__(self, m: GatewayMetrics, model: str, endpoint: str, stream: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.m, self.model, self.endpoint = m, model, endpoint
        self.request_type = "stream" if stream else "unary"
        self.clock = clock
        self.start = self.last = clock()
        self.first, self.done, self.failed = True, False, False
        self.output = 0
        m.inflight.labels(model).inc()
        m.queued.labels(model).inc()
        self._queued = True

    def _unqueue(self) -> None:
        if self._queued:
            self._queued = False
            self.m.queued.labels(self.model).dec()

    def tokens(self, n: int, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """``n`` new output tokens relayed now; the first call also records the prompt's
        ``prompt_tokens`` and ``cached_tokens``."""
        if n <= 0 or self.done:
            return
        m, model, now = self.m, self.model, self.clock()
        self.output += n
        m.count["output_tokens"].labels(model).inc(n)
        if self.first:  # several tokens in the first message: TTFT only, no ITL (as Dynamo)
            self.first = False
            self._unqueue()
            m.hist["time_to_first_token_seconds"].labels(model).observe(now - self.start)
            m.hist["input_sequence_tokens"].labels(model).observe(prompt_tokens)
            m.hist["cached_tokens"].labels(model).observe(cached_tokens)
            m.count["input_tokens"].labels(model).inc(prompt_tokens)
            m.count["cached_input_tokens"].labels(model).inc(cached_tokens)
        else:
            itl = m.hist["inter_token_latency_seconds"].labels(model)
            gap = (now - self.last) / n
            for _ in range(n):
                itl.observe(gap)
        self.last = now

    def fail(self) -> None:
        self.failed = True

    def finish(self, ok: bool = True) -> None:
        """The response ended (``ok``: and not with an error, also not one inside a stream)."""
        if self.done:
            return
        self.done = True
        m, model = self.m, self.model
        self._unqueue()
        m.inflight.labels(model).dec()
        ok = ok and not self.failed
        if ok and not self.first:  # a branch-end request (no engine, no token) counts, unobserved
            m.hist["request_duration_seconds"].labels(model).observe(self.clock() - self.start)
            m.hist["output_sequence_tokens"].labels(model).observe(self.output)
        m.count["requests"].labels(model, self.endpoint, self.request_type, "success" if ok else "error").inc()


class _ConsumerGauges(Collector):
    """``ei_consumer_pending_events{consumer}`` and ``ei_consumer_stuck{consumer}`` for every
    consumer of the stream; ``ei_gateway_events_refused_total{watch}`` for the gateway's own readers."""

    def __init__(self, report: Callable[[], dict], watches: Callable[[], list]) -> None:
        self.report, self.watches = report, watches

    def collect(self):
        rep = self.report()
        pending = GaugeMetricFamily("ei_consumer_pending_events",
                                    "messages waiting for (or not yet acknowledged by) each stream consumer",
                                    labels=["consumer"])
        stuck = GaugeMetricFamily("ei_consumer_stuck", "1 while a consumer with messages waiting has not moved",
                                  labels=["consumer"])
        for name, c in rep.get("consumers", {}).items():
            pending.add_metric([name], c.get("pending", 0))
            stuck.add_metric([name], 1.0 if c.get("state") == "stuck" else 0.0)
        refused = CounterMetricFamily("ei_gateway_events_refused", "events the gateway's readers refused "
                                      "(events/authority.py)", labels=["watch"])
        for st in self.watches():
            refused.add_metric([st.name], st.refused)
        yield from (pending, stuck, refused)
