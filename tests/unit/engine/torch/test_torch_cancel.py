"""Cancellation on the torch engine: a running decode stops between iterations
with ``RequestFinished(error="cancelled")``, its prompt's KV kept like a finished request's; a
queued request is dropped at once; the other requests of the batch run on."""

from __future__ import annotations

import asyncio

import pytest

from events.hashing import block_hashes
from tests.unit.engine.torch.cluster import Cluster, tiny_checkpoint
from tests.unit.engine.torch.test_torch_engine import prompt, reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _decode_steps(c, node="a"):
    return [e for e in c.of("IterationDone", node=node) if e.phase == "decode"]


async def test_a_running_decode_stops_and_the_batch_runs_on(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}).start()
    try:
        p1, p2 = prompt(11, 150), prompt(12, 70)
        c.submit("a", "r1", p1, 1500)
        c.submit("a", "r2", p2, 40)
        while len(_decode_steps(c)) < 5:
            await asyncio.sleep(0.001)
        assert c.nodes["a"].cancel("r1") is True
        await c.finished("r1", timeout=10.0)
        fin = c.of("RequestFinished", "r1")
        assert len(fin) == 1 and fin[0].error == "cancelled" and 1 < fin[0].output_tokens < 1500
        steps_then = len(_decode_steps(c))
        assert await c.finished("r2") == reference(ckpt, p2, 40)  # its batch-mate is unharmed
        assert all(e.batch == 1 for e in _decode_steps(c)[steps_then:])  # r1 is out of the batch
        assert "r1" not in c.nodes["a"].running and not c.nodes["a"].cancelling
        assert set(block_hashes(p1)) <= set(c.dir.copies("a", "L1"))  # the prompt's KV stays cached
        assert c.nodes["a"].cancel("r1") is False  # nothing left to stop
    finally:
        await c.stop()


async def test_a_queued_request_is_dropped_at_once(ckpt):
    c = await Cluster(ckpt, {"a": "collocated"}).start()
    try:
        c.submit("a", "r1", prompt(13, 100), 5)
        assert c.nodes["a"].cancel("r1") is True  # not started: the loop has not run yet
        fin = c.of("RequestFinished", "r1")
        assert len(fin) == 1 and fin[0].error == "cancelled" and fin[0].output_tokens == 0
        assert not c.of("RequestStarted", "r1") and not c.nodes["a"].pqueue
    finally:
        await c.stop()
