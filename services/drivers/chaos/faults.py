"""Fault injection for tests and ``evolving chaos``: a live service that crashes on cue.

``python -m services.drivers.chaos.faults SPEC KIND [serve options...]`` runs ``python -m services.drivers.serve KIND``
with one fault armed. Production entry points never read a fault switch; only this wrapper
arms one, through the runner's ``after_publish`` hook.

SPEC:
- ``crash_after_publish:N`` - exit with code 86 right after the batch holding the service's
  N-th published decision is confirmed by the bus, before the ack and the snapshot (the
  decision is on the stream but the service will fold its input again after a restart: the
  case message ids and ``Sequenced`` exist for).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from services.adapters.logging import get_logger
from services.drivers import serve

log = get_logger("faults")
FAULT_EXIT_CODE = 86


def parse(spec: str) -> Callable[[int], None]:
    """The ``after_publish`` hook for ``spec``; a clear ValueError for anything else."""
    kind, _, arg = spec.partition(":")
    if kind == "crash_after_publish" and arg.isdigit() and int(arg) > 0:
        limit = int(arg)

        def crash(published: int) -> None:
            if published >= limit:
                log.error("fault_injected", fault=spec, published=published)
                os._exit(FAULT_EXIT_CODE)

        return crash
    raise ValueError(f"unknown fault {spec!r}: expected crash_after_publish:N with N > 0")


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m services.drivers.chaos.faults SPEC KIND [serve options...]", file=sys.stderr)
        return 2
    spec, kind, *rest = argv
    try:
        hook = parse(spec)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    build = serve.build_runner

    def build_with_fault(*args, **kwargs):
        runner = build(*args, **kwargs)
        runner.after_publish = hook
        return runner

    serve.build_runner = build_with_fault
    return serve.main(kind, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
