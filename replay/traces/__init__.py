"""The agent-session trace format, importers, synthetic workloads, fits and statistics."""
