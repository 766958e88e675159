"""The command line and environment of one vLLM server on the CPU, as ``evolving up --engines
vllm`` launches it (services/drivers/up/vllm.py, which says why each option), and as
``evolving bench engine``'s vLLM column, ``evolving chaos --engines vllm`` and the compose file's
``vllm`` profile (services/drivers/up/vllm_server.py) launch theirs."""

from __future__ import annotations

import json
import sys

from engine.backends.vllm.options import bind_endpoint

KV_TOPIC = "kv"


def server_command(hf: str, served: str, url: str, kv_endpoint: str, *, block_size: int, max_model_len: int,
                   threads: int, kv_cache_gib: int, extra: list[str] = (),
                   pd_store: str | None = None, host: str = "127.0.0.1") -> tuple[list[str], dict[str, str]]:
    """The command and environment of one vLLM server on the CPU (module docstring); it listens on
    ``host`` (loopback for ``up``; every interface in a container, for the worker in another)."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": bind_endpoint(kv_endpoint),
              "topic": KV_TOPIC}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", hf, "--served-model-name", served,
           "--host", host, "--port", url.rsplit(":", 1)[1], "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--block-size", str(block_size), "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
           "--kv-events-config", json.dumps(events)]
    if pd_store:  # engine/backends/vllm/pd.py
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                                     "kv_connector_extra_config": {"shared_storage_path": pd_store}})]
    cmd += list(extra)
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),  # vLLM reads whole GiB
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads),
           "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    return cmd, env
