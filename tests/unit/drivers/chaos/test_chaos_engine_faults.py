"""``evolving chaos``'s engine fault wrapper: SIGUSR1 cuts the worker's next KV transfer
(services/drivers/chaos/engine_faults.py), and the scenario list names the new engine rows."""

from __future__ import annotations

import os
import signal

import pytest

import engine.worker.loop as worker_loop
from services.drivers.chaos import engine_faults
from services.drivers.chaos.scenarios import scenarios
from services.drivers.chaos.suite import select


def test_sigusr1_arms_a_cut_on_every_transfer_backend_the_worker_made():
    pytest.importorskip("torch")
    make, handler = worker_loop.make_transfer, signal.getsignal(signal.SIGUSR1)
    try:
        made = engine_faults.install()
        a = worker_loop.make_transfer("loopback", node="cut-a")
        b = worker_loop.make_transfer("loopback", node="cut-b")
        assert made == [a, b] and a.cut_transfers == b.cut_transfers == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert a.cut_transfers == b.cut_transfers == 1
    finally:
        worker_loop.make_transfer = make
        signal.signal(signal.SIGUSR1, handler)


def test_with_the_torch_backend_sigusr1_also_cuts_the_torch_engines_own_transfers():
    pytest.importorskip("torch")
    import engine.backends.torch.backend as torch_backend

    makes = (worker_loop.make_transfer, torch_backend.make_transfer)
    handler = signal.getsignal(signal.SIGUSR1)
    try:
        made = engine_faults.install(torch_backend=True)
        t = torch_backend.make_transfer("loopback", node="cut-t")
        assert made == [t] and t.cut_transfers == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert t.cut_transfers == 1
    finally:
        worker_loop.make_transfer, torch_backend.make_transfer = makes
        signal.signal(signal.SIGUSR1, handler)


def test_the_new_engine_scenarios_run_only_with_engines_and_only_the_cut_needs_kv_bytes():
    known = {s.name: s for s in scenarios()}
    assert known["cut-kv-transfer"].engines_only and known["cut-kv-transfer"].kv_bytes
    assert known["restart-gateway"].engines_only and not known["restart-gateway"].kv_bytes
    with pytest.raises(ValueError, match="run them with --engines"):
        select(scenarios(), only=["cut-kv-transfer"])
    quick = {s.name for s in select(scenarios(), quick=True)}
    assert not quick & {"cut-kv-transfer", "restart-gateway"}  # the quick suite without engines keeps its budget
    assert {"cut-kv-transfer", "restart-gateway"} <= {s.name for s in select(scenarios(), quick=True, engines=True)}
    assert {"cut-kv-transfer", "restart-gateway"} <= {s.name for s in select(scenarios(), engines=True)}
