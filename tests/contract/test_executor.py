"""One contract for the pools that run the matrix's rows (services/adapters/executors.py): the
standard library's Executor, here against InlineExecutor and ProcessPoolExecutor; tests/ray/
runs the same class against RayExecutor on a real local Ray cluster."""

from __future__ import annotations

import os
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context

import pytest

from services.adapters.executors import InlineExecutor


class ExecutorContract:
    """Subclasses give an ``executor`` fixture (shut down by the fixture). The jobs are builtins:
    a worker (a spawned process, a Ray worker) imports them without this test module."""

    def test_a_job_returns_its_value_through_its_future(self, executor: Executor):
        futs = [executor.submit(pow, k, 2) for k in range(5)]
        wait(futs, timeout=120)
        assert [f.result() for f in futs] == [0, 1, 4, 9, 16]

    def test_a_job_that_raises_leaves_its_exception_in_its_future_and_the_pool_goes_on(self, executor: Executor):
        bad = executor.submit(int, "row 3 broke")
        with pytest.raises(ValueError, match="row 3 broke"):
            bad.result(timeout=120)
        assert isinstance(bad.exception(), ValueError)
        assert executor.submit(pow, 7, 2).result(timeout=120) == 49

    def test_done_callbacks_see_each_finished_job(self, executor: Executor):
        seen: list[int] = []
        futs = [executor.submit(max, k, 0) for k in range(4)]
        for f in futs:
            f.add_done_callback(lambda f: seen.append(f.result()))
        wait(futs, timeout=120)
        deadline = time.monotonic() + 10  # a pool may run callbacks on its own thread just after
        while len(seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(seen) == [0, 1, 2, 3]

    def test_futures_are_standard_futures(self, executor: Executor):
        f = executor.submit(pow, 2, 2)
        assert isinstance(f, Future)
        assert f.result(timeout=120) == 4 and f.done() and not f.cancelled()

    def test_keyword_arguments_reach_the_job(self, executor: Executor):
        assert executor.submit(int, "ff", base=16).result(timeout=120) == 255


class TestInline(ExecutorContract):
    @pytest.fixture
    def executor(self):
        ex = InlineExecutor()
        yield ex
        ex.shutdown()

    def test_jobs_run_in_this_process_and_none_after_shutdown(self):
        ex = InlineExecutor()
        assert ex.submit(os.getpid).result() == os.getpid()
        ex.shutdown()
        with pytest.raises(RuntimeError, match="after shutdown"):
            ex.submit(pow, 3, 2)


@pytest.fixture(scope="module")
def process_pool():
    ex = ProcessPoolExecutor(max_workers=2, mp_context=get_context("spawn"))  # as evolving experiments --jobs 2
    yield ex
    ex.shutdown(wait=True, cancel_futures=True)


class TestProcesses(ExecutorContract):
    @pytest.fixture
    def executor(self, process_pool):
        return process_pool
