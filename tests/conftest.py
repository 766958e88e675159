"""Shared fixtures: a real nats-server per test session (free loopback port, temporary
JetStream store), and unique partitions so tests never see each other's streams."""

from __future__ import annotations

import itertools

import pytest

from services.natsserver import EmbeddedNats

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
