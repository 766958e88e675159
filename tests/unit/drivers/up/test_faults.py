"""The fault wrapper arms only what it is told, and refuses what it does not know."""

from __future__ import annotations

import pytest

from services.drivers.chaos import faults


def test_crash_after_publish_fires_at_the_nth_decision(monkeypatch):
    exits, logged = [], []
    monkeypatch.setattr(faults.os, "_exit", exits.append)

    class Log:
        def error(self, event, **kw):
            logged.append((event, kw))

    monkeypatch.setattr(faults, "log", Log())  # pytest swaps stdout
    hook = faults.parse("crash_after_publish:3")
    hook(1)
    hook(2)
    assert exits == []
    hook(3)
    assert exits == [faults.FAULT_EXIT_CODE]
    assert logged == [("fault_injected", {"fault": "crash_after_publish:3", "published": 3})]


@pytest.mark.parametrize("spec", ["", "crash_after_publish", "crash_after_publish:0", "crash_after_publish:x",
                                  "explode:3"])
def test_unknown_fault_is_refused_with_a_clear_error(spec):
    with pytest.raises(ValueError, match="unknown fault"):
        faults.parse(spec)


def test_the_runner_reads_no_fault_switch():
    import inspect

    from services.adapters import runner

    assert "EI_FAULT" not in inspect.getsource(runner) and "_exit" not in inspect.getsource(runner)
