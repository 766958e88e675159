"""Evolving Infra's services, one folder per layer (docs/contracts.md; tests/unit/layers checks it):

- ``cores/`` (layer 1): the pure decision cores - directory, planner, router, cost models,
  liveness, the recorder's batching, the worker's view; import only ``events``, numpy, scipy,
  msgspec and each other;
- ``adapters/`` (layer 2): one port per outside thing with its twins beside it - ``bus/``
  (NATS, in-memory, the embedded ``nats-server``, security), ``eventlog/`` (DuckDB, in-memory,
  views, the SQL sandbox), the runner, metrics, logging, plug-in loading;
- ``drivers/`` (layer 3): the table of services, ``evolving serve`` / ``up``, chaos, the recorder
  service and ``verify``, the gateway, the benches and the ``evolving`` CLI.
"""
