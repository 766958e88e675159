"""Node engines: the worker that serves a role, the L1/L2 KV pool model and backends (sim, sglang)."""
