"""``--kv-bytes`` with the sim backend: a request never runs on KV bytes that did not land.

The data plane (engine/kvplane.py) moves the bytes a KV fact implies after the node model
emitted it; every block travels with its checksum and the transfer layer refuses a read whose
bytes differ from the owner's (``TransferCorrupt``: a transfer cut mid-way), as the plane
refuses a P->D push that lands with another checksum. ``KvGate`` is the worker's reaction
(the "KV transfer cut mid-way" scenario of ``evolving chaos --engines``):

- ``KvFetched`` into this node (a queued prefill read a peer's blocks): the job waits until the
  bytes are in (its ``ready_s`` is put off), then runs; blocks refused or lost are evicted
  from both tiers first (``KvEvicted``: the directory forgets them), so the prefill computes
  them itself: ``RequestStarted(prefill).cached_tokens`` no longer counts them.
- ``KvMoved`` into this node (the prefill node pushed a decode's KV): refused blocks are
  evicted from L1 and stored again for the request (``KvStored``), i.e. recomputed here, whose
  bytes the plane then writes and checksums itself.

Each refusal is one ``kv_recompute`` log line and counts in ``recomputed_blocks``.
"""

from __future__ import annotations

import math

from events.catalog import Event, KvFetched, KvMoved
from services.adapters.logging import get_logger

log = get_logger("worker")


class KvGate:
    """Between the data plane and the sim node (module docstring). ``worker`` gives ``backend``
    (a ``SimBackend``: ``.node``), ``host`` and ``node_id``."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self._waiting: dict[str, int] = {}  # request -> fetches of its queued job still landing
        self.recomputed_blocks = 0
        self.refusals = 0

    @property
    def node(self):
        return self.worker.backend.node

    def _job(self, request: str):
        return next((j for j in self.node.pqueue if j.request == request and not j.started), None)

    def emitted(self, event: Event) -> None:
        """One of the node's own events, as it is emitted (after the plane saw it)."""
        if type(event) is KvFetched and event.dst_node == self.worker.node_id:
            job = self._job(event.request)
            if job is not None:
                self._waiting[event.request] = self._waiting.get(event.request, 0) + 1
                job.ready_s = math.inf  # not eligible until its bytes are in (landed)

    def landed(self, event: Event, missing: list[int]) -> None:
        """The plane's transfer for ``event`` ended; ``missing``: its blocks without verified bytes."""
        try:
            if missing:
                self._recompute(event, missing)
        finally:  # whatever happened, a job waiting for these bytes goes on
            if type(event) is KvFetched:
                self._release(event.request)

    def _recompute(self, event: Event, missing: list[int]) -> None:
        self.worker.host.catch_up()
        t = type(event)
        self.refusals += 1
        self.recomputed_blocks += len(missing)
        pool = self.node.pool
        if t is KvFetched:
            for tier in ("L1", "L2"):
                pool.observe_removed(tier, missing)
            job = self._job(event.request)
            if job is not None:
                gone = set(missing)
                job.fetched = [(src, [b for b in blocks if b not in gone]) for src, blocks in job.fetched]
                job.fetched = [(src, blocks) for src, blocks in job.fetched if blocks]
        elif t is KvMoved:
            running = self.node.running.get(event.request)
            pool.observe_removed("L1", missing)
            pins = running.blocks if running is not None else missing
            pool.store("L1", missing, pins, event.request)
        log.warning("kv_recompute", node=self.worker.node_id, request=event.request, kv_event=t.__name__,
                    src=event.src_node, blocks=len(missing),
                    action="prefill computes them" if t is KvFetched else "recomputed on the decode node")

    def _release(self, request: str) -> None:
        if request not in self._waiting:
            return
        left = self._waiting[request] - 1
        if left > 0:
            self._waiting[request] = left
            return
        del self._waiting[request]
        job = self._job(request)
        if job is not None:
            job.ready_s = self.worker.host.catch_up()
            self.node.kick()
