"""The vLLM backend: one running vLLM server, attached by URL (docs/engines.md)."""
