"""The executor contract (tests/contract/test_executor.py) against RayExecutor on a real local
Ray cluster (tests/ray/conftest.py), and what only Ray has: a description of the cluster, and a
clear error when there is no cluster at the address."""

from __future__ import annotations

import os

import pytest

from services.adapters.executors import RayExecutor, RayUnavailable
from tests.contract.test_executor import ExecutorContract

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_executor(ray_cluster):
    ex = RayExecutor(ray_cluster)
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)


class TestRay(ExecutorContract):
    @pytest.fixture
    def executor(self, ray_executor):
        return ray_executor

    def test_jobs_run_in_the_clusters_workers_and_it_describes_itself(self, ray_executor, ray_cluster):
        pids = {f.result(timeout=120) for f in [ray_executor.submit(os.getpid) for _ in range(4)]}
        assert os.getpid() not in pids
        assert ray_executor.cpus() == 2
        assert ray_executor.describe().endswith(f"at {ray_cluster}: 2 CPUs on 1 node(s)")


def test_auto_without_a_cluster_on_this_machine_says_so(ray_installed, monkeypatch, tmp_path):
    """``auto`` looks for a cluster started on this machine (RAY_ADDRESS, then Ray's record of
    the latest one under its temp folder): none there is a RayUnavailable, not a hang."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    with pytest.raises(RayUnavailable, match="no Ray cluster at 'auto'"):
        RayExecutor("auto")
