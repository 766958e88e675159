"""The OpenAI-compatible gateway: HTTP in, harness events out, tokens streamed back.

Layer 3 (a driver). ``api`` (request Structs, error shape, parameter rules; pure),
``headers`` (branch signals, pure), ``tokenizer`` (byte-level / HF, chat template, pure),
``auth`` (API keys), ``metrics`` (prometheus_client), ``tokens`` (token channel adapters over
``events.wire``), ``app`` (aiohttp), ``drive`` (trace replay client), ``cli`` (``evolving
drive``). May import ``events``, ``services.adapters.bus.nats_bus`` / ``services.adapters.logging`` and ``replay.traces.format``
(drive); nothing below it imports this package. See docs/gateway.md.
"""
