"""What the attached-server backend tests share (tests/integration/test_sglang_backend.py,
test_vllm_backend.py): a wall-clock worker host that keeps every event and token, with a wait
for the first event a predicate accepts, and a prefill job of whole 64-token blocks plus 7."""

from __future__ import annotations

import asyncio

from engine.backend import PrefillJob
from engine.worker.host import WallClockHost


class Host:
    def __init__(self):
        self.events, self.tokens = [], []
        self.host = WallClockHost(1.0, self.events.append, lambda *a: [], lambda n: None, token=self.tokens.append)

    async def wait(self, pred, timeout=20.0):
        async def poll():
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                await asyncio.sleep(0.01)
        return await asyncio.wait_for(poll(), timeout)


def job(rid, blocks, decode="d1", max_tokens=5):
    return PrefillJob(request=rid, blocks=list(blocks), prompt_tokens=len(blocks) * 64 + 7, max_tokens=max_tokens,
                      decode_node=decode, fetch_plan=[], enqueued_s=0.0)
