"""The OpenAI-compatible gateway: HTTP in, harness events out, tokens streamed back.

``headers`` (branch signals, pure), ``tokenizer`` (byte-level / HF, chat template, pure),
``tokens`` (token streaming subject), ``app`` (aiohttp), ``drive`` (trace replay client),
``cli`` (``evolving drive``). See docs/gateway.md.
"""
