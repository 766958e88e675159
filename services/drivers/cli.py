"""The ``evolving`` command line. Each package contributes its subcommands.

A contributing module exposes ``register(sub, bench)``: ``sub`` is the top-level subparsers
object, ``bench`` the subparsers of ``evolving bench``. A subparser sets ``func`` (called with
the parsed args, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from services.adapters.logging import configure_logging

#: Modules that add subcommands, in help order. A missing module is skipped.
COMMAND_MODULES = (
    "services.drivers.nats_cli",
    "services.drivers.bench.cli",
    "replay.cli",
    "replay.experiments.cli",
    "services.drivers.recorder.cli",
    "services.drivers.up.cli",
    "services.drivers.chaos.cli",
    "services.drivers.soak.cli",
    "services.drivers.bench.kv_cli",
    "services.drivers.bench.dynamo_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evolving",
        description="Evolving Infra: agent-adaptive control plane for PD-disaggregated LLM serving",
    )
    parser.add_argument("--log-format", choices=["console", "json"], default=None)
    parser.add_argument("--log-level", default=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = sub.add_parser("bench", help="benchmarks (figures with a side-by-side baseline)")
    bench = bench_parser.add_subparsers(dest="bench", metavar="BENCH")
    bench_parser.set_defaults(func=lambda a: (bench_parser.print_help(), 2)[1])
    for mod_name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            if exc.name and mod_name.startswith(exc.name):
                continue  # the module does not exist (yet)
            raise
        mod.register(sub, bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(level=args.log_level, fmt=args.log_format)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
