"""Leaving a process that imported Mooncake's transfer engine.

The Mooncake wheel (``mooncake-transfer-engine-non-cuda`` 0.3.13) sometimes aborts the
interpreter's teardown: ``terminate called without an active exception`` (a ``std::thread``
still joinable when a static object is destroyed), exit status -6 after the process had done
all its work and closed its engine. Measured here (loops of two ``engine.transfer.node``
processes, a read, a write and a quit each): 4 of 420 processes aborted with other work on both
cores (0 of 180 in the same loops through :func:`exit_process`), 0 of 30 on an idle machine;
``-X faulthandler`` shows the main thread with no Python frame, i.e. after ``main`` had
returned. CI saw it once in
``tests/integration/test_transfer_mooncake.py`` ("a node did not quit cleanly").

:func:`exit_process` flushes what the process wrote and ends it with ``os._exit`` when
Mooncake's engine module was imported in it (the kernel closes its sockets; nothing of ours
runs at exit), and with ``sys.exit`` otherwise. Only a ``__main__`` calls it: never code that runs inside a
test process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_process(rc: int) -> NoReturn:
    if "mooncake.engine" not in sys.modules:
        sys.exit(rc)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to flush to
            pass
    os._exit(rc)
