"""Engine backends behind the port of :mod:`engine.backend`, one folder each: ``sim`` (the
simulated node over the shared KV pool), ``torch`` (the reference engine computing a real model),
``sglang`` and ``vllm`` (one server of that engine, launched or attached). What several backends
share sits here, beside them: ``attached.py`` (an attached HTTP server, synthetic prompt ids),
``kvmap.py`` (an engine's page hashes -> our block hashes), ``kv_frames.py`` (the KV-event ZMQ
frames), ``fake_server.py``; no backend imports another."""
