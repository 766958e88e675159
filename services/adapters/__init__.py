"""Layer 2, the adapters: one port per outside thing, with its twins beside it (docs/contracts.md).

- ``bus/`` - the bus port, ``NatsBus`` (JetStream) and ``InMemoryBus``, the embedded
  ``nats-server``, accounts and credentials, the engines' token channel;
- ``eventlog/`` - the event log port, ``DuckDbEventLog`` and ``InMemoryEventLog``, the typed
  views and the read-only SQL sandbox;
- ``runner.py`` - the generic service runner (durable consumer -> core -> decisions, snapshots);
- ``metrics.py`` - Prometheus metrics and the health endpoint of each service;
- ``logging.py`` - structlog set-up;
- ``plugins.py`` - routers and planners found by entry point.

Engine backends, KV transfers and kernels are adapters too; they live in ``engine/`` and
``kernels/``. May import: the cores, ``events``, the outside libraries.
"""
