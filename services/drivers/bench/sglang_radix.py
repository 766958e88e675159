"""SGLang's Python radix tree on the directory bench's requests (run by ``evolving bench
directory --sglang-python``, under SGLang's own interpreter; never imported by the project or
its tests).

Input: an ``.npz`` with ``ids`` (every request's block ids, densely renumbered to int64 so they
fit SGLang's token tensors) and ``offsets`` (request boundaries). Per request, as the bare-dict
baseline does: ``match_prefix`` of the block list, then ``insert`` of it (page size 1: one tree
token per block; keys as ``array("q")``, the type SGLang's ``RadixKey`` declares).

Rounds. The process loads the input once, prints ``{"ready": true}`` and then runs one round per
line ``run`` on its stdin: a fresh ``RadixCache``, every request folded, one line
``{"wall_s": ..., "cpu_s": ..., "requests": ...}`` printed; it exits on EOF or ``quit``. So the
bench (``directory.run``) alternates a directory round and a SGLang round in the same minute,
``repeats`` times: a load swing on the shared machine hits both sides. While the bench's own
side runs this process is blocked on its stdin (no CPU), and the other way round.

GC: the same setting as the directory's side of the bench (``directory.run``): the cyclic GC stays
on, the loaded input is frozen out of it (``gc.freeze()``) before the first round, and each
round starts after the previous round's tree is dropped and ``gc.collect()``, as each directory
round does.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from array import array

import numpy as np


def main(path: str) -> int:
    import torch  # lazy: optional dependency (sglang)
    from sglang.srt.mem_cache.base_prefix_cache import (  # lazy: optional dependency (sglang)
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # lazy: optional dependency (sglang)
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # lazy: optional dependency (sglang)

    data = np.load(path)
    ids, offsets = data["ids"], data["offsets"]
    values = torch.arange(len(ids), dtype=torch.int64)  # stand-in KV indices, sliced per request
    keys = [array("q", ids[a:b].tolist()) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    starts = offsets[:-1].tolist()
    gc.collect()
    gc.freeze()  # as the directory's side does (see the module docstring)
    print(json.dumps({"ready": True, "requests": len(keys)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                          page_size=1))
        gc.collect()
        t0, c0 = time.perf_counter(), time.thread_time()
        for key, a in zip(keys, starts):
            tree.match_prefix(MatchPrefixParams(key=RadixKey(key)))
            tree.insert(InsertParams(key=RadixKey(key), value=values[a:a + len(key)]))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        del tree
        print(json.dumps({"wall_s": wall, "cpu_s": cpu, "requests": len(keys)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
