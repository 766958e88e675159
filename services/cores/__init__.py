"""Layer 1, the decision cores: pure folds of the event stream (docs/contracts.md, "Cores").

No I/O, no clock (time is ``event.ts``), no unseeded randomness, ties by sorted ids; each core
has ``apply(event) -> list[Event]``, ``snapshot()`` and ``from_snapshot()``.

- ``contract.py`` - the ``Core`` protocol and ``Sequenced`` (the applied stream position);
- ``directory/`` - the agent-aware KV directory, lookups, count-aware and LRU eviction;
- ``planner/`` - the Evolving Infra planner and the baselines, one file per policy;
- ``router/`` - least predicted TTFT and the baseline routers, one file per policy;
- ``costmodel.py`` - eq. 1 / eq. 2 and their NNLS fit (planner and router share it);
- ``liveness.py`` - the heartbeat watcher the planner service runs beside the planner;
- ``corestack.py`` - several cores folded as one behind one consumer;
- ``partitions.py`` - the partition map (nodes and sessions to partitions);
- ``recording.py`` - the recorder's batching of deliveries for the event log;
- ``worker_view.py`` - what an engine worker knows of its partition.

May import: ``events``, numpy, scipy, msgspec, and each other.
"""
