"""Node engines, layer 2 (adapters): the engine port (:mod:`engine.backend`), the L1/L2 KV pool
model (``kvpool``), the KV data plane (``kvplane``, ``kvbytes``, ``transfer/``), the engine
profiles, and the backends behind the port (``backends/``: sim, torch, sglang, vllm). The node
worker process that serves a role over the bus is ``engine/worker/`` (layer 3, drivers)."""
