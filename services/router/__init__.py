"""The router: places each request on a prefill node and a decode node (METHOD.md §4.4).

- :mod:`services.router.state` — the cluster as routers see it (nodes, roles, queues), folded
  from events;
- :mod:`services.router.base` — the :class:`Router` protocol and the shared fold (echo,
  shadow, re-routing on a switch, cold start, snapshots);
- :mod:`services.router.core` — :class:`LeastTtftRouter`, least predicted TTFT (eq. 7);
- :mod:`services.router.baselines` — cache-aware (SGLang Model Gateway), sticky, round robin,
  least loaded, Dynamo KV router;
- ``evolving bench router`` and the event-stream builders of its scenarios live in
  :mod:`services.bench` (drivers stand above the core).

All routers are found by name through the entry-point group ``evolving.routers``.

Layer 1 (core). May import: ``events``, ``services.core``, ``services.costmodel``, the directory
core (each router folds its own replica), numpy, msgspec.
"""

from services.router.base import Router, RouterBase

__all__ = ["Router", "RouterBase"]
