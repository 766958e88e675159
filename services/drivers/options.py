"""Command-line options of a service (``evolving serve NAME``), parsed once at its entry point:
the bus options every live process shares (services/adapters/bus/options.py), the common ones
of a service (metrics, snapshots), then its row's of the services table (services/services.py).
:func:`service_options` turns them into :class:`ServiceOptions`, what services/drivers/serve.py
and the table's ``configure`` read; nothing below sees the ``Namespace``.

Nothing here starts anything, so ``evolving --help`` can build every parser without loading the
runner, the recorder or DuckDB.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from services.adapters.bus.options import BusSpec, add_bus_args, bus_spec
from services.drivers.services import SERVICES

#: how long a service keeps trying to start through transient bus errors before it exits 1
START_RETRY_S = 60.0


@dataclass(frozen=True, kw_only=True)
class ServiceOptions:
    """One service's options as parsed: the bus, the common ones (named as their flags), and
    ``row``, the options of its row of the services table by destination (``--planner-arg`` ->
    ``"planner_arg"``), typed by that row's argparse definitions."""

    kind: str
    bus: BusSpec = field(default_factory=BusSpec)
    metrics_port: int | None = None  # None: no /metrics server
    metrics_host: str = "127.0.0.1"
    snapshot_every: int = 5000
    snapshot_interval_s: float = 60.0
    start_timeout_s: float = START_RETRY_S
    row: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, kind: str, bus: BusSpec | None = None, **flags: Any) -> ServiceOptions:
        """From keywords named as the flags (a test's or an in-process run's): the common ones go
        to their fields, the rest to ``row``."""
        own = {f.name for f in fields(cls)} - {"kind", "bus", "row"}
        return cls(kind=kind, bus=bus or BusSpec(), **{k: v for k, v in flags.items() if k in own},
                   row={k: v for k, v in flags.items() if k not in own})


def service_options(kind: str, args: argparse.Namespace) -> ServiceOptions:
    """``evolving serve KIND``'s parsed flags (:func:`add_service_args`, ``--start-timeout-s``)."""
    row = {a: getattr(args, a) for a in (o.dest for o in SERVICES[kind].options)}
    common = {f: getattr(args, f) for f in ("metrics_port", "metrics_host", "snapshot_every", "snapshot_interval_s")}
    return ServiceOptions(kind=kind, bus=bus_spec(args), start_timeout_s=getattr(args, "start_timeout_s", None)
                          or START_RETRY_S, row=row, **common)


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
