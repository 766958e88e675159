"""An engine worker with a fault it arms on cue, for ``evolving chaos --engines``.

``python -m services.drivers.chaos.engine_faults [engine.worker options...]`` runs
``python -m engine.worker`` unchanged, except that SIGUSR1 arms ``cut_transfers`` on the
worker's KV transfer backend (the sim's ``--kv-bytes`` data plane, or the torch engine's own
transfers with ``--backend torch``; engine/transfer/base.py): its next transfer moves
only the first half of its bytes and reports success, as a link cut mid-way would. The receiver's
checksums must refuse it and the request recompute the blocks (engine/worker/kvgate.py).
Production entry points never read a fault switch; only this wrapper arms one (as
:mod:`services.drivers.chaos.faults` does for the services).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

import engine.worker.loop as worker_loop
from engine.worker.__main__ import main as worker_main


def install(torch_backend: bool = False) -> list:
    """Record every transfer backend the worker makes (the sim's data plane's, or with
    ``torch_backend`` the torch engine's own); SIGUSR1 cuts each one's next transfer."""
    made: list = []
    modules = [worker_loop]
    if torch_backend:
        import engine.backends.torch.backend as torch_backend_module  # lazy: optional dependency (torch)

        modules.append(torch_backend_module)

    def recording(make):
        def wrapped(*args, **kwargs):
            backend = make(*args, **kwargs)
            made.append(backend)
            return backend
        return wrapped

    def arm(signum, frame) -> None:  # only an attribute write: safe between any two bytecodes
        for backend in made:
            backend.cut_transfers += 1

    for module in modules:
        module.make_transfer = recording(module.make_transfer)
    signal.signal(signal.SIGUSR1, arm)
    return made


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    backend = argv[argv.index("--backend") + 1] if "--backend" in argv[:-1] else "sim"
    install(torch_backend=backend == "torch")
    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
