"""The sim engine streams one chunk per decode iteration: the worker's progress loop wakes when
the run's next iteration ends (``progress_wait_s`` over ``SimBackend.next_progress_s``), so a
client sees each token at its own time, as from vLLM or SGLang, not a chunk per
``--token-interval-s`` (the old pacing put 15 of 16 tokens in one chunk)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

from engine.backends.sim.backend import SimBackend
from engine.worker.loop import MIN_PROGRESS_S, progress_loop, progress_wait_s
from events.catalog import RequestFinished
from tests.contract.test_backend import PROFILE, Harness, job


async def _stream(max_tokens: int, scale: float, interval_s: float, paced: bool):
    h = Harness(scale)
    h.backend = SimBackend(h.host, "n1", "collocated", PROFILE, seed=1)
    runner = asyncio.create_task(h.host.run())

    async def unpaced():  # the worker's loop before it paced the sim's output
        while True:
            await asyncio.sleep(interval_s)
            h.host.catch_up()
            h.backend.progress()

    ticker = asyncio.create_task(progress_loop(h.backend, h.host, interval_s) if paced else unpaced())
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
    assert progress_wait_s(Idle(), 0.2) is None  # no run yet: wait for the host's next schedule
    assert progress_wait_s(Due(), 0.2) == MIN_PROGRESS_S


def _idle_backend():
    """A backend with no run to pace that counts the loop's ``progress`` calls."""

    class Counting:
        calls = 0

        def next_progress_s(self):
            return None

        def progress(self):
            Counting.calls += 1

    return Counting


async def test_an_idle_loop_sleeps_until_the_host_schedules():
    """No run to pace: the loop does not poll (it asked every 20 ms, 50 wake-ups a second per
    idle engine), and a schedule wakes it at once, so a run's first chunk is not late."""
    h = Harness(1.0)

    Counting = _idle_backend()
    loop = asyncio.create_task(progress_loop(Counting(), h.host, 10.0))
    try:
        await asyncio.sleep(0.3)
        assert Counting.calls == 0
        t0 = asyncio.get_running_loop().time()
        h.host.schedule(h.host.clock() + 100.0, lambda: None)
        while Counting.calls == 0 and asyncio.get_running_loop().time() - t0 < 5:
            await asyncio.sleep(0.001)
        assert Counting.calls == 1 and asyncio.get_running_loop().time() - t0 < 1.0
    finally:
        loop.cancel()


async def test_an_idle_loop_wakes_once_a_second_not_at_the_token_interval():
    """With no run and no schedule the loop's safety wake-up comes every ``IDLE_WAKE_S`` (1 s),
    not every ``--token-interval-s`` (0.2 s: five idle wake-ups a second per engine)."""
    h = Harness(1.0)

    Counting = _idle_backend()
    loop = asyncio.create_task(progress_loop(Counting(), h.host, 0.2))
    try:
        await asyncio.sleep(1.5)
        assert 1 <= Counting.calls <= 2, Counting.calls  # 0.2 s: 7
    finally:
        loop.cancel()
