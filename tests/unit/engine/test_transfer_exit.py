"""``exit_process`` (engine/transfer/exit.py): a process that imported Mooncake's engine leaves
with ``os._exit`` after flushing, so the wheel's teardown cannot abort it; any other process
leaves through ``sys.exit``, its exit handlers run. Each case runs in its own interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import atexit, sys, types
if {made}:
    sys.modules["mooncake.engine"] = types.ModuleType("mooncake.engine")  # what MooncakeTransfer imports
atexit.register(lambda: print("exit handlers ran", file=sys.stderr))
from engine.transfer.exit import exit_process
sys.stdout.write("reply without a newline")  # buffered: lost unless flushed
exit_process(3)
"""


@pytest.mark.parametrize("made", [True, False])
def test_exit_process_keeps_the_status_and_the_output(made):
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(made=made)], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "reply without a newline"
    # with Mooncake imported, nothing runs at exit (where the wheel's abort was)
    assert ("exit handlers ran" in proc.stderr) is (not made)
