"""The gateway's Prometheus metrics (prometheus_client, one private registry per app, so
several gateways can live in one process, as they do in tests).

Counters: ``ei_gateway_requests_total{endpoint}``, ``ei_gateway_headerless_requests_total``,
``ei_gateway_errors_total{status,code}``, ``ei_gateway_compactions_total{reason}``,
``ei_gateway_branches_opened_total``, ``ei_gateway_branches_ended_total``,
``ei_gateway_output_tokens_total``, ``ei_gateway_route_timeouts_total``.
Gauges (read when scraped): ``ei_gateway_open_branches``, ``ei_gateway_in_flight_requests``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ei_gateway_requests_total": ("completion requests received, by endpoint", ("endpoint",)),
    "ei_gateway_headerless_requests_total": ("requests without branch headers (one-request branches)", ()),
    "ei_gateway_errors_total": ("requests answered with an error, by HTTP status and error code",
                                ("status", "code")),
    "ei_gateway_compactions_total": ("ContextCompacted published, by reason (header|inferred)", ("reason",)),
    "ei_gateway_branches_opened_total": ("BranchOpened published", ()),
    "ei_gateway_branches_ended_total": ("BranchEnded published", ()),
    "ei_gateway_output_tokens_total": ("output tokens relayed to clients", ()),
    "ei_gateway_route_timeouts_total": ("requests with no RouteDecided in time", ()),
}
CONTENT_TYPE = CONTENT_TYPE_LATEST


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
