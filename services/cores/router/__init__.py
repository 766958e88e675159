"""The router: places each request on a prefill node and a decode node (METHOD.md §4.4).

- :mod:`services.cores.router.state` — the cluster as routers see it (nodes, roles, queues), folded
  from events;
- :mod:`services.cores.router.base` — the :class:`Router` protocol and the shared fold (echo,
  shadow, re-routing on a switch, cold start, snapshots);
- :mod:`services.cores.router.least_ttft` — :class:`LeastTtftRouter`, least predicted TTFT (eq. 7);
- :mod:`services.cores.router.cache_aware` — SGLang Model Gateway's cache-aware and sticky policies;
- :mod:`services.cores.router.load_balancing` — round robin and least loaded;
- :mod:`services.cores.router.dynamo` — Dynamo's KV router cost (overlap against load);
- ``evolving bench router`` and the event-stream builders of its scenarios live in
  :mod:`services.drivers.bench` (drivers stand above the core).

All routers are found by name through the entry-point group ``evolving.routers``.

Layer 1 (core). May import: ``events``, ``services.cores.contract``, ``services.cores.costmodel``, the directory
core (each router folds its own replica), numpy, msgspec.
"""

from services.cores.router.base import Router, RouterBase

__all__ = ["Router", "RouterBase"]
