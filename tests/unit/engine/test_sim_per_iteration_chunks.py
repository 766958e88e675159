"""The sim engine streams one chunk per decode iteration: the worker's progress loop wakes when
the run's next iteration ends (``progress_wait_s`` over ``SimBackend.next_progress_s``), so a
client sees each token at its own time, as from vLLM or SGLang, not a chunk per
``--token-interval-s`` (the old pacing put 15 of 16 tokens in one chunk)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

from engine.backends.sim.backend import SimBackend
from engine.worker.loop import MIN_PROGRESS_S, PACED_IDLE_S, progress_wait_s
from events.catalog import RequestFinished
from tests.contract.test_backend import PROFILE, Harness, job


async def _stream(max_tokens: int, scale: float, interval_s: float, paced: bool):
    h = Harness(scale)
    h.backend = SimBackend(h.host, "n1", "collocated", PROFILE, seed=1)
    runner = asyncio.create_task(h.host.run())

    async def progress():  # the worker's loop (engine/worker/loop.py, _progress)
        while True:
            wait = progress_wait_s(h.backend, interval_s) if paced else interval_s
            await asyncio.sleep(wait)
            h.host.catch_up()
            h.backend.progress()

    ticker = asyncio.create_task(progress())
    try:
        h.host.catch_up()
        h.backend.enqueue_prefill(replace(job("r", max_tokens=max_tokens), ignore_eos=True))
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r", timeout=60)
        return fin, [m for m in h.tokens if m.request == "r"]
    finally:
        ticker.cancel()
        runner.cancel()
        await h.backend.close()


async def test_one_chunk_per_iteration():
    # iterations of PROFILE's decode time / 0.05 in wall time: long beside the loop's wake-up jitter
    fin, msgs = await _stream(16, scale=0.05, interval_s=10.0, paced=True)
    assert fin.output_tokens == 16 and msgs[0].kind == "first" and msgs[-1].kind == "done"
    per = [m.tokens for m in msgs if m.kind == "chunk"]
    assert sum(per) + 1 + msgs[-1].tokens == 16
    # each iteration's tokens in a chunk of their own (a late wake-up may merge two: allow one)
    iters = math.ceil(15 / PROFILE.t_acc)  # after the first token, PROFILE.t_acc tokens an iteration
    assert len(per) >= iters - 2 and max(per) <= 2 * math.ceil(PROFILE.t_acc), (per, PROFILE.t_acc)
    stamps = [m.ts for m in msgs]
    assert stamps == sorted(stamps) and len(set(stamps)) >= iters - 1  # model times of their own


async def test_without_pacing_the_interval_batches_them():
    """The contrast that makes the test above mean something: a 10 s interval, no pacing, and
    the run's tokens come in the iteration-end chunk and the done message only."""
    _fin, msgs = await _stream(16, scale=0.05, interval_s=10.0, paced=False)
    assert len([m for m in msgs if m.kind == "chunk"]) <= 2


def test_the_wait_is_the_interval_without_a_run_and_never_under_the_floor():
    class Idle:
        def next_progress_s(self):
            return None

    class Due:
        def next_progress_s(self):
            return 0.0

    assert progress_wait_s(object(), 0.2) == 0.2  # a backend that does not pace its output
    assert progress_wait_s(Idle(), 0.2) == PACED_IDLE_S  # no run yet: asked again soon
    assert progress_wait_s(Due(), 0.2) == MIN_PROGRESS_S
