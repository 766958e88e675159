"""Runs the real Dynamo's offline replay (``dynamo.replay.run_trace_replay``, ai-dynamo 1.6.1) in
its own venv (``.venv-dynamo``, ``bash scripts/setup.sh --dynamo``): ``python dynamo_child.py
SPEC.json OUT.json``. Standard library and ``dynamo`` only: it never imports our packages (the
two venvs pin different pydantic versions; docs/experiments.md, "Against the real Dynamo").

SPEC: ``{"trace", "block_size", "concurrency", "router_mode", "prefill_workers",
"decode_workers", "workers", "prefill_engine_args", "decode_engine_args", "engine_args"}``
(``workers`` > 0: aggregated workers with ``engine_args``; else disaggregated). OUT: the
replay's ``summary``, its per-request records (id, session, turn, arrival, TTFT, E2E, input,
output, reused input tokens) and the call's wall and CPU time.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time

# This folder holds our dynamo.py: ``import dynamo`` must find the package, not it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from dynamo.replay import run_trace_replay  # lazy: after the path fix above, only in .venv-dynamo

    kw = {"router_mode": spec.get("router_mode", "kv_router"), "trace_block_size": spec["block_size"],
          "trace_format": "mooncake", "replay_concurrency": spec.get("concurrency"), "capture_per_request": True}
    if spec.get("workers"):
        kw.update(extra_engine_args=spec["engine_args"], num_workers=spec["workers"])
    else:
        kw.update(prefill_engine_args=spec["prefill_engine_args"], decode_engine_args=spec["decode_engine_args"],
                  num_prefill_workers=spec["prefill_workers"], num_decode_workers=spec["decode_workers"])
    t0, c0 = time.perf_counter(), time.process_time()
    rep = run_trace_replay([spec["trace"]], **kw)
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    reqs = [{k: r.get(k) for k in ("uuid", "session_id", "turn_index", "arrival_time_ms", "ttft_ms",
                                   "e2e_latency_ms", "input_length", "output_length", "reused_input_tokens",
                                   "terminal_status", "prefill_worker_idx", "decode_worker_idx",
                                   "source_held_ms")}
            for r in (rep.per_request or [])]
    out = {"summary": {k: v for k, v in rep.summary.items() if isinstance(v, (int, float, str)) or v is None},
           "requests": reqs, "wall_s": wall_s, "cpu_s": cpu_s,
           "version": importlib.metadata.version("ai-dynamo")}
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
