"""The planner: iteration-time cost models (``costmodel``), the Evolving Infra planner
(``core.EvolvingPlanner``) and the baseline planners (``baselines``). See docs/planner.md."""
