"""The torch engine's capacities: a full L1 makes requests wait for room (a request takes its whole
working memory when it starts, so a running one never runs out), a prompt that can never fit
fails alone and the node goes on, and the worker registers the pools the engine allocated,
not the profile's figures. The linear kernels: oneDNN's packed GEMM and ``F.linear`` give the
same greedy tokens, and oneDNN's rows do not depend on the batch they are computed in."""

from __future__ import annotations

import pytest
import torch

from engine.backends.torch import options
from engine.backends.torch.backend import Message, TorchBackend, TorchConfig
from engine.backends.torch.model import Linear, Llama, onednn_linear_available
from engine.kvplane import LocalExchange
from engine.transfer.loopback import LoopbackFabric
from engine.worker.loop import EngineWorker
from events.catalog import NodeRegistered
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.unit.engine.torch.cluster import PROFILE, Cluster, tiny_checkpoint
from tests.unit.engine.torch.test_torch_engine import prompt, reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-cap") / "tiny.gguf")


async def test_a_full_l1_makes_the_next_request_wait_and_a_prompt_that_never_fits_fails_alone(ckpt):
    # 8 blocks of L1; r1 and r2 need 5 each (260 prompt + 8 output tokens): r2 waits for r1
    c = await Cluster(ckpt, {"a": "collocated"}, l1_blocks=8, l2_blocks=16).start()
    try:
        p1, p2, big = prompt(21, 260), prompt(22, 260), prompt(23, 600)
        c.submit("a", "r1", p1, 8)
        c.submit("a", "r2", p2, 8)
        assert await c.finished("r1") == reference(ckpt, p1, 8)
        assert await c.finished("r2") == reference(ckpt, p2, 8)
        idx = {(type(e).__name__, e.request, getattr(e, "phase", "")): i for i, e in enumerate(c.events)
               if type(e).__name__ in ("RequestStarted", "RequestFinished")}
        assert idx[("RequestStarted", "r2", "prefill")] > idx[("RequestFinished", "r1", "")]
        assert max(e.batch for e in c.of("IterationDone") if e.phase == "decode") == 1  # never both at once
        c.submit("a", "big", big, 4)  # 10 blocks of prompt alone: never fits 8
        c.submit("a", "r3", p1, 3)
        assert await c.finished("r3") == reference(ckpt, p1, 3)
        errors = [m for m in c.tokens if m.kind == "error"]
        assert [m.request for m in errors] == ["big"] and "does not fit" in errors[0].error
        assert c.nodes["a"].counters["failed"] == 1 and c.nodes["a"].kv.pool.reserved_tokens == 0
    finally:
        await c.stop()


async def test_the_worker_registers_the_pools_the_engine_allocated(ckpt, partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    fabric, exchange = LoopbackFabric(), LocalExchange(messages=Message)
    cfg = TorchConfig(l1_blocks=24, l2_blocks=40, staging_blocks=4, token_budget=512, max_running=6,
                      fabric=fabric, exchange=exchange)
    factory = options.registering(lambda host, w: TorchBackend(host, w.src, "collocated", PROFILE, cfg,
                                                               checkpoint=ckpt))
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, backend=factory)
    try:
        await w.start()
        reg = w.registration()
        assert (reg.l1_capacity_tokens, reg.l2_capacity_tokens) == (24 * 64, 40 * 64)
        assert (reg.max_running_requests, reg.prefill_token_budget) == (6, 512)
        assert reg.l1_capacity_tokens != PROFILE.l1_capacity_tokens
        published = []
        async with bus.consumer(None, start_seq=1) as cons:
            async for d in cons:
                published.append(d.event)
                if isinstance(d.event, NodeRegistered):
                    break
        assert published[-1].l1_capacity_tokens == 24 * 64 and published[-1].node == "n1"
    finally:
        await w.stop()


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch has no oneDNN")
def test_onednn_and_aten_linear_layers_give_the_same_greedy_tokens(ckpt):
    ref = Llama(ckpt.cfg, ckpt.weights, linear="aten")
    dnn = Llama(ckpt.cfg, ckpt.weights, linear="onednn")
    assert (ref.linear, dnn.linear) == ("aten", "onednn")
    for seed in (31, 32):
        p = prompt(seed, 90)
        assert reference(ckpt, p, 12) == reference_with(ref, ckpt, p, 12) == reference_with(dnn, ckpt, p, 12)
    w = ckpt.weights["layers.0.gate"]
    lin = Linear(w, packed=True)
    x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(4))
    full = lin(x)
    assert torch.allclose(full, torch.nn.functional.linear(x, w), atol=1e-5)
    assert all(torch.equal(full[i], lin(x[i:i + 1])[0]) for i in range(16))  # rows independent of the batch
    h = torch.randn(16, w.shape[0])
    assert torch.allclose(lin(x, add=h), h + full, atol=1e-6)
    with pytest.raises(ValueError, match="linear must be"):
        Llama(ckpt.cfg, ckpt.weights, linear="mkl")


def reference_with(model, ckpt, p, n):
    saved = ckpt.models.pop(("ref",), None)
    ckpt.models[("ref",)] = model
    try:
        return reference(ckpt, p, n)
    finally:
        del ckpt.models[("ref",)]
        if saved is not None:
            ckpt.models[("ref",)] = saved
