"""The torch reference engine: a Llama-architecture model computing in torch behind the engine
port (``backend.TorchBackend``), with paged KV in the ``kernels`` pools (``kv``), the model
(``model``), checkpoint loading (``loader``: GGUF or safetensors) and the worker's options
(``options``). Importing this package does not import torch; docs/engines.md, "The torch
reference engine"."""
