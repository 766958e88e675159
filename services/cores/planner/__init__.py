"""The planner (METHOD.md §4.3): the Evolving Infra planner and the baselines, one file per policy.

- :mod:`.base` - the shared fold (nodes, warm-up, model fitting, ``ModelFitted``, switch orders);
- :mod:`.window` / :mod:`.evaluate` - the 600 s window and the candidate evaluation;
- :mod:`.evolving` - ``EvolvingPlanner``: switches only when the mean gain exceeds 2 SE;
- :mod:`.configured` - the baselines' base: a configured split ordered at warm-up end;
- :mod:`.static` - ``StaticPlanner``: never switches (SGLang PD at a fixed split);
- :mod:`.load_signals` - per-node load folded from request events, read by the two below;
- :mod:`.dynamo` - ``DynamoPlanner``: Dynamo's load-based planner (queued prefill tokens,
  decode KV utilisation; by restart);
- :mod:`.arrow` - ``ArrowPlanner``: Arrow's instance scheduling (TTFT from total input
  length, in place but dropping the node's KV).

The iteration-time cost models are :mod:`services.cores.costmodel`. What each baseline
reproduces, and where it is our reading, is in docs/planner.md. All planners are found by name
through the entry-point group ``evolving.planners``.

Layer 1 (core). May import: ``events``, ``services.cores.contract``, ``services.cores.costmodel``,
numpy, scipy, msgspec. Its benchmark and synthetic data are in ``services.drivers.bench``.
"""
