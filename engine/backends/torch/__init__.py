"""The torch reference engine: a Llama-architecture model computing in torch behind the engine
port (``backend.TorchBackend``: the scheduler), with paged KV in the ``kernels`` pools (``kv``),
the model (``model``), the batch as the model's inputs (``step``), KV moves between nodes
(``peers``), configuration and per-request state (``state``), checkpoint loading (``loader``:
GGUF or safetensors) and the worker's options (``options``). Importing this package does not
import torch; docs/engines.md, "The torch reference engine"."""
