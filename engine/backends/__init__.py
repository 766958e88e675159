"""Engine backends behind the port of :mod:`engine.backend`: ``sim`` (the simulated node over
the shared KV pool) and ``sglang`` (one SGLang server, launched or attached), one folder each."""
