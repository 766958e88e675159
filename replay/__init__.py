"""Agent traces, workload generators, importers, the cluster simulator, log replay, reports."""
