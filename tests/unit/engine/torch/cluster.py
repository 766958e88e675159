"""Torch engines in one process: a tiny random Llama checkpoint (GGUF, written by the test),
nodes on one loopback fabric and one in-process control exchange, a shared directory folding
what every node emits, and the worker's prefill -> decode hand-off (a peer's ``FirstToken``
admits the decode: ``kv_arrived``)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from engine.backend import DecodeJob, PrefillJob
from engine.backends.torch.backend import Message, TorchBackend, TorchConfig
from engine.backends.torch.loader import load, random_weights, write_gguf
from engine.backends.torch.model import LlamaConfig
from engine.kvplane import LocalExchange
from engine.profiles import load_profile
from engine.transfer.loopback import LoopbackFabric
from engine.worker.host import WallClockHost
from events.catalog import FirstToken, NodeRegistered, RequestFinished
from events.hashing import block_hashes
from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import LruEviction

PROFILE = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0)
TINY = LlamaConfig(vocab=384, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, rope_base=10000.0, max_pos=2048)


def tiny_checkpoint(path, tokens=None, seed: int = 3):
    write_gguf(path, TINY, random_weights(TINY, seed), tokens=tokens)
    return load(str(path))


class Cluster:
    def __init__(self, ckpt, roles: dict[str, str], **cfg) -> None:
        self.ckpt = ckpt
        self.events, self.tokens = [], []
        self.dir = DirectoryCore()
        self.policy = LruEviction(64)
        self.fabric, self.exchange = LoopbackFabric(), LocalExchange(messages=Message)
        self.jobs: dict[str, PrefillJob] = {}
        self.nodes: dict[str, TorchBackend] = {}
        self.hosts: dict[str, WallClockHost] = {}
        for n, role in roles.items():
            host = WallClockHost(1.0, self._emit_for(n), self.choose, lambda node: None, token=self.tokens.append)
            self.hosts[n] = host
            c = TorchConfig(**{"fabric": self.fabric, "exchange": self.exchange, "l1_blocks": 64, "l2_blocks": 128,
                               "staging_blocks": 16, **cfg})
            self.nodes[n] = TorchBackend(host, n, role, PROFILE, c, checkpoint=ckpt)
        self._runners = []

    def _emit_for(self, node):
        def emit(e):
            self.events.append(e)
            self.dir.apply(e)
            if type(e) is FirstToken:
                job = self.jobs.get(e.request)
                if job is not None and job.decode_node != e.node:
                    dj = DecodeJob(request=job.request, blocks=job.blocks, prompt_tokens=job.prompt_tokens,
                                   left=float(job.max_tokens - 1), total_out=job.max_tokens,
                                   context=float(job.prompt_tokens + 1), src_node=e.node, tokens=job.tokens,
                                   max_tokens=job.max_tokens, ignore_eos=job.ignore_eos, sampling=job.sampling)
                    asyncio.get_running_loop().call_soon(self.nodes[job.decode_node].kv_arrived, dj)
        return emit

    def choose(self, node, tier, tokens, pinned):
        return self.policy.choose(self.dir, node, tier, tokens, pinned)

    async def start(self):
        for n, b in self.nodes.items():
            self.dir.apply(NodeRegistered(ts=0.0, src=n, node=n, role=b.role, gpus=1,
                                          l1_capacity_tokens=b.kv.pool.l1_cap_blocks * 64,
                                          l2_capacity_tokens=b.kv.pool.l2_cap_blocks * 64))
            await b.start()
            self._runners.append(asyncio.create_task(self.hosts[n].run()))
        for n, b in self.nodes.items():
            for m, o in self.nodes.items():
                if m != n:
                    b.peer_registered(m, o.transfer_endpoint)
        return self

    async def stop(self):
        for r in self._runners:
            r.cancel()
        for b in self.nodes.values():
            await b.close()

    def submit(self, node, rid, tokens, max_tokens, decode=None, fetch_plan=(), blocks=None, prompt=None,
               sampling=None, ignore_eos=None):
        blocks = blocks if blocks is not None else (block_hashes(tokens) if tokens is not None else [])
        job = PrefillJob(request=rid, blocks=blocks, prompt_tokens=prompt or len(tokens), max_tokens=max_tokens,
                         decode_node=decode or node, fetch_plan=list(fetch_plan), enqueued_s=0.0, tokens=tokens,
                         sampling=sampling, ignore_eos=ignore_eos)
        self.jobs[rid] = job
        self.hosts[node].catch_up()
        self.nodes[node].enqueue_prefill(job)
        return job

    async def finished(self, rid, timeout=20.0):
        async def poll():
            while not any(type(e) is RequestFinished and e.request == rid for e in self.events):
                await asyncio.sleep(0.005)
        await asyncio.wait_for(poll(), timeout)
        return self.output(rid) if self.ckpt.tokenizer is None else self.text(rid)

    def text(self, rid) -> str:
        return "".join(m.text for m in self.tokens if m.request == rid)

    def output(self, rid) -> list[int]:
        """Token ids from the text (the checkpoint has no tokenizer: ids as text)."""
        return [int(t) for t in self.text(rid).split()]

    def of(self, kind, rid=None, node=None):
        return [e for e in self.events if type(e).__name__ == kind and (rid is None or getattr(e, "request", None) == rid)
                and (node is None or getattr(e, "node", getattr(e, "dst_node", None)) == node)]
