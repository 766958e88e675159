"""``evolving chaos --workdir DIR`` with a DIR that does not exist yet: the stack makes it (it
used to end in a FileNotFoundError at the first service's log)."""

from __future__ import annotations

from services.drivers.chaos.supervisor import ChaosCluster


def test_a_missing_workdir_is_made(tmp_path):
    workdir = tmp_path / "not" / "there"
    stack = ChaosCluster(workdir)
    assert workdir.is_dir()
    assert stack.db.parent == workdir and all(p.parent == workdir for p in stack.logs.values())
