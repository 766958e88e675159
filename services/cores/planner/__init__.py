"""The planner: iteration-time cost models (``costmodel``), the Evolving Infra planner
(``core.EvolvingPlanner``) and the baseline planners (``baselines``). See docs/planner.md.

Layer 1 (core). May import: ``events``, ``services.cores.contract``, ``services.cores.costmodel``, numpy, scipy,
msgspec. Its benchmark and synthetic data are in ``services.drivers.bench``.
"""
