"""``evolving serve`` moves what is alive once its service is ready out of the cyclic GC's reach
(services/drivers/serve.py, ``freeze_gc_when_ready``): not before the backlog is folded."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

from services.drivers.serve import freeze_gc_when_ready


def test_the_heap_is_frozen_once_the_runner_is_ready_and_not_before():
    async def scenario() -> tuple[int, int, int]:
        runners: list = []
        task = asyncio.create_task(freeze_gc_when_ready(runners))
        await asyncio.sleep(0.1)
        before_runner = gc.get_freeze_count()
        runner = SimpleNamespace(ready=asyncio.Event(), cfg=SimpleNamespace(name="router"))
        runners.append(runner)
        await asyncio.sleep(0.1)
        before_ready = gc.get_freeze_count()
        runner.ready.set()
        await asyncio.wait_for(task, 5)
        return before_runner, before_ready, gc.get_freeze_count()

    gc.unfreeze()
    try:
        before_runner, before_ready, after = asyncio.run(scenario())
    finally:
        gc.unfreeze()  # the test process's heap goes back under the GC
    assert before_runner == 0 and before_ready == 0
    assert after > 1000  # the modules and objects alive at that moment
