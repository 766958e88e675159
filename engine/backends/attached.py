"""What every backend attached to an engine server shares (SGLang, vLLM): the server's load from
its Prometheus ``/metrics``, its KV events over ZMQ folded into the node's pool, the token
channel and the engine-port properties. A subclass sets the class attributes below and holds
``host``, ``node_id``, ``_role``, ``cfg`` (``url``, ``metrics_interval_s``), ``_http``, ``jobs``,
``started``, ``pool``, ``pagemap``, ``server_load``, ``kv_seq`` and ``kv_gaps``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import aiohttp
import zmq
import zmq.asyncio

from engine.backend import NodeLoad
from events.ids import NodeId, Role
from events.wire import TokenMsg
from services.adapters.logging import get_logger

log = get_logger("engine")


def prom_sum(text: str, metric: str) -> float:
    """Sum of every sample of ``metric`` in Prometheus text exposition (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric) and line[len(metric):len(metric) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


class AttachedServer:
    """Mixin: the server-facing half both attached backends have in common (module docstring)."""

    engine_name: ClassVar[str]  # "sglang" / "vllm": log event names, ``<name>_metrics_off``
    running_metric: ClassVar[str]  # the server's gauge of running requests
    queued_metric: ClassVar[str]  # ... and of queued ones
    metrics_off_note: ClassVar[str] = ""  # what to tell the operator when /metrics is 404
    parse_frames: ClassVar[Callable[[list[bytes]], tuple[Any, int, Any]]]  # the three ZMQ frames

    def _now(self) -> float:
        catch_up = getattr(self.host, "catch_up", None)
        return catch_up() if catch_up is not None else self.host.now

    @property
    def role(self) -> Role:
        return self._role

    @property
    def id(self) -> NodeId:
        return self.node_id

    def _token(self, **kw) -> None:
        self.host.token(TokenMsg(node=self.node_id, ts=self._now(), **kw))

    def load(self) -> NodeLoad:
        """Requests this worker sent, or the server's own gauges when larger (a decode server
        also runs the requests its prefill peers sent it)."""
        running, queued = len(self.started), len(self.jobs) - len(self.started)
        if self.server_load is not None:
            running, queued = max(running, self.server_load[0]), max(queued, self.server_load[1])
        return NodeLoad(role=self._role, running=running, queued=queued,
                        l1_used_tokens=self.pool.used_tokens("L1"), l2_used_tokens=self.pool.used_tokens("L2"))

    async def _poll_metrics(self) -> None:
        """The server's running / queued gauges from ``/metrics``, summed over label sets (one per
        DP rank). A server that answers 404 exports none: polling stops and the load counts only
        this worker's requests."""
        while True:
            await asyncio.sleep(self.cfg.metrics_interval_s)
            try:
                async with self._http.get(f"{self.cfg.url}/metrics") as r:
                    if r.status == 404:
                        log.warning(f"{self.engine_name}_metrics_off", url=self.cfg.url, note=self.metrics_off_note)
                        return
                    text = await r.text()
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue  # restarting: keep the last reading
            self.server_load = (int(prom_sum(text, self.running_metric)), int(prom_sum(text, self.queued_metric)))

    async def _kv_events(self, endpoints: list[str], topic: str) -> None:
        """Subscribe to the server's KV events (one publisher per DP rank) and fold every batch;
        a gap in a rank's sequence is counted and logged, a restarted publisher starts over."""
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        for ep in endpoints:
            sock.connect(ep)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            while True:
                parts = await sock.recv_multipart()
                try:
                    _, seq, batch = type(self).parse_frames(parts)
                except Exception as exc:  # noqa: BLE001 - a bad message is counted, not fatal
                    log.error("kv_event_unreadable", engine=self.engine_name, error=str(exc))
                    continue
                rank = batch.attn_dp_rank or 0  # one sequence per DP rank
                last = self.kv_seq.get(rank, -1)
                if 0 <= seq <= last:  # the publisher restarted (a relaunch): its sequence starts over
                    last = -1
                if last >= 0 and seq != last + 1:
                    self.kv_gaps += 1
                    log.warning("kv_event_gap", engine=self.engine_name, rank=rank, expected=last + 1, got=seq)
                self.kv_seq[rank] = seq
                self.apply_kv(batch)
        finally:
            sock.close(linger=0)

    def apply_kv(self, batch) -> None:
        self._observe(self.pagemap.apply(batch))

    def _observe(self, changes: Iterable) -> None:
        """The page map's changes into the node's pool (what the directory then learns)."""
        for ch in changes:
            if ch.kind == "stored":
                self.pool.observe_stored(ch.tier, ch.blocks)
            elif ch.kind == "evicted":
                self.pool.observe_removed(ch.tier, ch.blocks)
            else:
                self.pool.drop_all()
