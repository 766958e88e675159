"""Benchmarks and synthetic inputs for the decision cores (driver layer).

- :mod:`.directory` - ``evolving bench directory`` (lookup + fold on real sessions vs a bare dict);
- :mod:`.planner` and :mod:`.synthetic` - ``evolving bench planner`` and the synthetic
  iteration data it (and the planner tests) use;
- :mod:`.router` and :mod:`.scenario` - ``evolving bench router`` and the small event-stream
  builders it (and the router tests) use;
- :mod:`.cli` - registers the three commands.

Layer 3 (driver). May import anything below it: events, the cores, the adapters (plug-in loading).
"""
