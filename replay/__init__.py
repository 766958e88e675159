"""Agent traces and the cluster simulator (docs/traces.md, docs/simulator.md, docs/experiments.md).

- ``traces/`` (layer 2, an adapter: the trace files) - the session format, importers of real
  agent logs, synthetic workloads, fits, statistics, pacing; the gateway's ``evolving drive``
  reads it too;
- ``sim/`` (layer 3) - the discrete-event simulator driving the real cores with the sim engine
  on a virtual clock: stacks, runs, partitioned runs, figures, reports, ``evolving replay |
  compare | sweep-static | sim-report | bench sim``;
- ``experiments/`` (layer 3) - ``evolving experiments``: the paper's matrix as data, its runner
  and plots;
- ``cli.py`` - the ``evolving trace ...`` commands.
"""
