"""Evolving Infra services: bus adapter, pure decision cores and their service adapters.

Layers (docs/contracts.md; tests/unit/layers checks them):

- cores (layer 1): ``core``, ``costmodel``, ``directory``, ``planner``, ``router`` - pure; import
  only ``events``, numpy, scipy, msgspec and each other;
- adapters (layer 2): ``bus``, ``runner``, ``recorder``, ``metrics``, ``natsserver``, ``logging``,
  ``plugins`` - talk to NATS, DuckDB, Prometheus, processes; import cores and ``events``;
- drivers (layer 3): ``live``, ``gateway``, ``bench``, ``cli``, ``buscli`` and every
  ``__main__`` - may import anything below them.
"""
