"""The live control plane: one process per service around the pure cores, and ``evolving up``.

- :mod:`services.adapters.runner` - the generic adapter (durable consumer -> core -> decisions);
- :mod:`.metrics` - Prometheus metrics and the health endpoint of each service;
- :mod:`.stack` / :mod:`.liveness` - a stack of cores behind one consumer; the heartbeat
  watcher that the planner service runs beside the planner;
- :mod:`.serve` - ``python -m services.<name>`` / ``evolving serve <name>``;
- :mod:`.up` - ``evolving up`` (NATS, services, sim engines, gateway, status line);
- :mod:`.bench` - ``evolving bench live``.

See docs/live.md.

Layer 3 (driver). May import everything below: adapters, cores, ``events``.
"""
