"""Layer 2, the adapters: one folder or module per outside thing (bus, event log, metrics, logging, plug-ins), each port beside its twins."""
