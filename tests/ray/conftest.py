"""A real local Ray cluster for the ``ray`` suite (``pytest -m ray tests/ray``; bash
scripts/install_ray.sh installs Ray into .venv): services/adapters/ray_head.py's head (``ray
start --head --block`` in a temporary folder, free ports, 2 CPUs, a 200 MB object store, a token
of its own), the same one scripts/bench_experiments_ray.py starts; stopped at the end by id."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from services.adapters.ray_head import local_ray_head, ray_command


@pytest.fixture(scope="session")
def ray_installed() -> None:
    """Skips (each test, so the suite reports why) where Ray is not installed. Looked up, not
    imported: Ray reads its auth settings once, when first imported."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed: bash scripts/install_ray.sh (the ray extra)")


@pytest.fixture(scope="session")
def ray_cluster(ray_installed):
    """The head's address (``HOST:PORT``), with the auth token in this process's environment."""
    if ray_command() is None:
        pytest.skip("no ray command in this environment: bash scripts/install_ray.sh")
    tmp = Path(tempfile.mkdtemp(prefix="ei-ray-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    try:
        with local_ray_head(tmp, num_cpus=2, start_timeout_s=90) as (address, _pid):
            yield address
        print(f"ray cluster {address} stopped", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
