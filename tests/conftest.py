"""Shared fixtures: a real nats-server per test session (free loopback port, temporary
JetStream store), and unique partitions so tests never see each other's streams.

Hypothesis profiles (docs/planner.md, "Property tests"): ``ci``, loaded by default and so in
CI, is deterministic (``derandomize=True``: every run tries the same examples, no example
database, no deadline, the failing example's blob printed); ``fuzz``
(``HYPOTHESIS_PROFILE=fuzz``, ``just fuzz``) draws fresh random examples, more of them, and
keeps the ones that fail in the local ``.hypothesis/`` database to look for new
counterexamples."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, settings

from services.adapters.bus.natsserver import EmbeddedNats
from tests.hyp import examples

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],  # timing-based: flaky on a loaded machine
)
settings.register_profile("fuzz", derandomize=False, max_examples=examples(1000), deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")

_partition_ids = itertools.count(1)


@pytest.fixture(scope="session")
def nats_server():
    with EmbeddedNats() as srv:
        yield srv


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
def partition(request) -> str:
    """A partition name unique to this test."""
    return f"t{next(_partition_ids)}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "hostile: the hostile suite: every account of a secured `evolving up` sends bad "
                   "bytes and forged events; in the default suite and so in .ci/run")
