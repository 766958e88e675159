"""Per-service Prometheus metrics and a small HTTP endpoint (``/metrics``, ``/healthz``).

Each service owns one :class:`ServiceMetrics` with its own registry (several services may
share a process in tests and in ``evolving bench live``). Names:

=================================  =========  =============================================
metric                             type       meaning
=================================  =========  =============================================
``ei_service_lag_events``          gauge      stream head - last applied sequence
``ei_service_applied_seq``         gauge      last stream sequence folded
``ei_service_events_folded_total`` counter    events folded through the core (redeliveries
                                              excluded)
``ei_service_redeliveries_total``  counter    deliveries at or below the applied sequence
``ei_service_decisions_total``     counter    emitted events published, by ``type``
``ei_service_anomalies_total``     counter    ``AnomalyReported`` published, by ``kind``
``ei_service_dead_letters_total``  counter    messages this service sent to the dead-letter
                                              subject (undecodable, or the core raised)
``ei_service_snapshots_total``     counter    snapshots written
``ei_service_republish_skipped``   counter    decisions found already on the stream while
                                              replaying the tail after a restart
=================================  =========  =============================================

Every metric has the label ``service``. ``/healthz`` answers 200 with a JSON status while the
service runs (the runner's :meth:`health`), 503 before it has caught up with its backlog.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from services.adapters.logging import get_logger

log = get_logger("metrics")


class ServiceMetrics:
    """The metrics of one service, in a registry of its own."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["service"]
        self.lag = Gauge("ei_service_lag_events", "stream head minus the last applied sequence", lab, registry=r)
        self.applied = Gauge("ei_service_applied_seq", "last stream sequence folded", lab, registry=r)
        self.folded = Counter("ei_service_events_folded", "events folded through the core", lab, registry=r)
        self.redelivered = Counter("ei_service_redeliveries", "deliveries already applied", lab, registry=r)
        self.decisions = Counter("ei_service_decisions", "emitted events published", lab + ["type"], registry=r)
        self.anomalies = Counter("ei_service_anomalies", "AnomalyReported published", lab + ["kind"], registry=r)
        self.dead_letters = Counter("ei_service_dead_letters", "messages sent to the dead-letter subject",
                                    lab, registry=r)
        self.refused = Counter("ei_service_events_refused",
                               "events the authority rule refused (events/authority.py): dead-lettered, not folded",
                               lab, registry=r)
        self.dead_letter_failed = Counter("ei_service_dead_letters_failed",
                                          "dead letters the bus did not take (logged whole instead)", lab, registry=r)
        self.snapshots = Counter("ei_service_snapshots", "snapshots written", lab, registry=r)
        self.republish_skipped = Counter("ei_service_republish_skipped",
                                         "decisions already on the stream when the tail was replayed",
                                         lab, registry=r)
        for m in (self.lag, self.applied, self.folded, self.redelivered, self.dead_letters, self.snapshots,
                  self.republish_skipped, self.refused, self.dead_letter_failed):
            m.labels(service)  # export zeros from the start

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (tests and the status line)."""
        v = self.registry.get_sample_value(name, {"service": self.service, **labels})
        return float(v or 0.0)

    def total(self, name: str) -> float:
        """Sum of a labelled counter over all its label values."""
        out = 0.0
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name == name and s.labels.get("service") == self.service:
                    out += s.value
        return out

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """aiohttp server for ``/metrics`` and ``/healthz``. ``port=0`` binds a free port
    (``self.port`` is the bound one); construct it only when metrics are wanted."""

    def __init__(self, metrics: ServiceMetrics, health: Callable[[], dict[str, Any]],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.metrics, self.health, self.host, self.port = metrics, health, host, port
        self._runner = None

    async def start(self) -> MetricsServer:
        async def metrics(_req):
            return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def healthz(_req):
            h = self.health()
            return web.Response(text=json.dumps(h), status=200 if h.get("ready") else 503,
                                content_type="application/json")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the bound port when 0 was asked
        log.info("metrics_listening", service=self.metrics.service, url=f"http://{self.host}:{self.port}/metrics")
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
