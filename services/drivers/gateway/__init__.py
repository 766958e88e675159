"""The OpenAI-compatible gateway: HTTP in, harness events out, tokens streamed back.

Layer 3 (a driver). ``api`` (request Structs, error shape, parameter rules; pure),
``headers`` (branch signals, pure), ``tokenizer`` (byte-level / HF, the simple chat template,
pure), ``model`` (``--tokenizer``: the model's tokenizer and template from a GGUF file, a
tokenizer.json or a folder), ``gguf_meta`` (GGUF metadata without the tensors), ``chat_template``
(the model's Jinja template, sandboxed),
``auth`` (API keys), ``metrics`` (prometheus_client), ``app`` (aiohttp: ``Gateway``), ``config``,
``guard``, ``routewatch``, ``meta``, ``openai_relay``, ``anthropic_relay`` (its parts), ``drive``
(trace replay client), ``cli`` (``evolving drive``). The token channel it shares with the engines is an
adapter, ``services.adapters.bus.tokens``. May import ``events``, the adapters (bus, logging)
and ``replay.traces`` (drive); nothing imports this package but the CLI. See docs/gateway.md.
"""
