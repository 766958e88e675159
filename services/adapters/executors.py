"""Pools that run independent jobs (the experiment matrix's rows): the port is the standard
library's :class:`concurrent.futures.Executor` (``submit(fn, *args) -> Future``, ``shutdown``).

Its implementations, run by the same contract tests (tests/contract/test_executor.py, and
tests/ray/ for Ray):

- :class:`concurrent.futures.ProcessPoolExecutor`: worker processes on this machine, the default
  of ``evolving experiments --jobs N``;
- :class:`InlineExecutor`: this process, each job run when it is submitted (the in-memory twin);
- :class:`RayExecutor`: each job a Ray task on a Ray cluster, so rows spread over its machines
  (``evolving experiments --ray ADDRESS``).

Ray is an optional extra (``pip install 'evolving-infra[ray]'``, or ``bash scripts/install_ray.sh``):
``ray`` is imported when a :class:`RayExecutor` is made, never by importing this module. A job
is a picklable module-level function and its arguments; on a Ray cluster, every node must import
the same code (the same install of this project) for a row to run there as it runs here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class InlineExecutor(Executor):
    """Runs each job in this process when it is submitted: the future comes back done. An
    exception is the future's, as in a pool."""

    def __init__(self) -> None:
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("cannot submit after shutdown")
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the job's failure is its future's, as in a pool
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster at the address cannot be reached."""


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


class RayExecutor(Executor):
    """Each job a Ray task taking ``cpus_per_job`` CPUs (default 1: a row is one single-threaded
    simulation), so the cluster runs as many at a time as it has CPUs, on any of its nodes.

    ``address`` is Ray's own (``ray.init(address=...)``): ``HOST:PORT`` of a running cluster's
    head (``ray start --head`` prints it), ``auto`` for the cluster started on this machine, or
    ``local`` for a new single-machine instance that lives as long as this executor (then
    ``num_cpus`` and ``object_store_memory`` size it; a running cluster keeps its own sizes).
    ``shutdown`` disconnects (and stops a ``local`` instance); with ``cancel_futures`` the jobs
    still queued or running are cancelled first (``ray.cancel(force=True)`` ends their workers)."""

    def __init__(self, address: str, *, num_cpus: int | None = None, object_store_memory: int | None = None,
                 cpus_per_job: float = 1.0) -> None:
        try:
            import ray  # lazy: an optional extra, imported only when asked for
        except ImportError as exc:
            raise RayUnavailable(f"ray is not installed ({exc}): pip install 'evolving-infra[ray]' "
                                 f"or bash scripts/install_ray.sh") from None
        self._ray = ray
        self.address = address
        extra: dict[str, Any] = {}
        if address == "local":
            extra = {"num_cpus": num_cpus, "object_store_memory": object_store_memory, "include_dashboard": False}
        try:
            # log_to_driver off: a row's own output stays in the cluster's worker logs, not in the tables
            ray.init(address=address, log_to_driver=False, logging_level="warning", **extra)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayUnavailable(f"no Ray cluster at {address!r}: {' '.join(str(exc).split())[:300]}") from None
        self._task = ray.remote(num_cpus=cpus_per_job)(_call)
        self._lock = threading.Lock()
        self._refs: list[Any] = []
        self._closed = False

    def describe(self) -> str:
        """``Ray 2.60.0 at ADDRESS: 4 CPUs on 2 nodes``."""
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        cpus = self._ray.cluster_resources().get("CPU", 0)
        return f"Ray {self._ray.__version__} at {self.address}: {cpus:g} CPUs on {len(nodes)} node(s)"

    def cpus(self) -> int:
        return int(self._ray.cluster_resources().get("CPU", 0))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit after shutdown")
            ref = self._task.remote(fn, args, kwargs)
            self._refs.append(ref)
        return ref.future()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            refs, self._refs = self._refs, []
        if cancel_futures and refs:
            _done, pending = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in pending:
                self._ray.cancel(ref, force=True)
        elif wait and refs:
            self._ray.wait(refs, num_returns=len(refs))
        self._ray.shutdown()
