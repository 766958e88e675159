"""Command-line options of a service (``evolving serve NAME``), parsed once at its entry point:
the bus options every live process shares (services/adapters/bus/options.py), the common ones
of a service (metrics, snapshots), then its row's of the services table (services/services.py).

Nothing here starts anything, so ``evolving --help`` can build every parser without loading the
runner, the recorder or DuckDB.
"""

from __future__ import annotations

import argparse

from services.adapters.bus.options import add_bus_args
from services.drivers.services import SERVICES


def add_common(p: argparse.ArgumentParser) -> None:
    add_bus_args(p)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics and /healthz on this port (0: a free port; default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--snapshot-every", type=int, default=5000, help="events between snapshots")
    p.add_argument("--snapshot-interval-s", type=float, default=60.0,
                   help="seconds between snapshots (services/adapters/runner.py, RunnerConfig)")


def add_service_args(p: argparse.ArgumentParser, kind: str) -> None:
    """The options of ``evolving serve KIND``: the common ones, then its row's."""
    add_common(p)
    for option in SERVICES[kind].options:
        p.add_argument(*option.flags, **option.kwargs)
