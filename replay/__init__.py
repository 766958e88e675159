"""Agent traces, workload generators, importers, the cluster simulator, log replay, reports.

Layer 3 (driver): the simulator drives the real cores with the sim engine backend, on a virtual
clock. May import everything below it (``engine`` backends, adapters, cores, ``events``).
"""
