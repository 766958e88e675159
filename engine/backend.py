"""The engine port: what the worker (engine/worker/) needs from an engine, whatever runs it.

Four backends implement it (``engine/backends/``): ``sim`` (the simulated node model over the
shared KV pool), ``sglang`` (one SGLang server, launched by the worker or attached by URL),
``vllm`` (one running vLLM server, attached by URL) and ``torch`` (the reference engine
computing with a Llama model in torch).
The worker never reaches behind the port; tests/contract/test_backend.py runs the same
contract against each (SGLang and vLLM through their protocol-faithful fakes).

Direction of calls
- Worker -> backend: commands, all non-blocking (a backend that talks to a server over the
  network starts a task and reports the outcome later as events):
  ``enqueue_prefill(job)`` (a non-shadow ``RouteDecided`` named this node; ``job.fetch_plan`` is
  the router's plan), ``remove_queued(request)`` (a reroute away: only a request that has not
  started), ``kv_arrived(job)`` (this node decodes a request prefilled elsewhere: its KV is
  here now), ``order_switch(to_role, mechanism)`` (``SwitchRole``), ``progress()`` (every
  token interval: report the tokens produced so far), ``load()`` (for heartbeats),
  ``cancel(request)`` (``RequestCancelled``: the client went away; stop the request wherever it
  is on this node - a queued prefill at once, a running one within an iteration - and report
  ``RequestFinished(error="cancelled")``; False when the node does not hold it).
- Backend -> worker: through the :class:`WorkerHost` it was built with, callback style, in
  the order things happen on the engine: ``host.emit(event)`` for every catalog fact
  (``RequestStarted``, ``IterationDone``, ``FirstToken``, ``RequestFinished``, ``KvStored``,
  ``KvEvicted``, ``KvFetched``, ``KvMoved``, ``RoleSwitched`` - "the switch is done" is the
  ``RoleSwitched`` event), ``host.token(msg)`` for the text streamed to the gateway.
  Nothing is buffered inside the port: the worker applies each event to its directory and
  publishes it at once, so eviction sees the node's own KV without a bus round trip.

Time is the host's model time (``host.now``); a backend never reads the wall clock for a fact
it reports, except the SGLang backend, which stamps what the server did when it learns of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from events.catalog import Event, FetchStep
from events.ids import BlockHash, NodeId, RequestId, Role, SwitchMechanism, Tier
from events.wire import TokenMsg


@dataclass(slots=True)
class PrefillJob:
    """One request to prefill on this node. The first seven fields are the order (what the
    route and the request say); the rest is the backend's bookkeeping."""

    request: RequestId
    blocks: Sequence[BlockHash]
    prompt_tokens: int
    max_tokens: int
    decode_node: NodeId
    fetch_plan: Sequence[FetchStep]
    enqueued_s: float
    priority: int = 0  # nvext.agent_hints.priority: higher is served earlier (sim node's queue)
    # the prompt's real token ids (from the gateway's prompt store); None for a replayed trace
    # that carries no tokens (a backend then makes ids from the block hashes)
    tokens: Sequence[int] | None = None
    ready_s: float = 0.0  # async fetch done
    fetch_start_s: float = 0.0
    fetch_s: float = 0.0
    fetched: list = field(default_factory=list)  # [(src, blocks)] done asynchronously
    started: bool = False
    t_c: int = 0
    t_uc: int = 0
    done_uc: int = 0
    t_rst: int = 0
    start_fetch_s: float = 0.0  # fetch-at-start time charged to the first iteration
    fetch_busy_mark: float = 0.0


@dataclass(slots=True)
class DecodeJob:
    """One request to decode on this node once its KV has arrived."""

    request: RequestId
    blocks: Sequence[BlockHash]
    prompt_tokens: int
    left: float  # output tokens still to generate
    total_out: int
    context: float
    src_node: NodeId
    tokens: Sequence[int] | None = None  # the prompt's token ids, as PrefillJob.tokens


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What a heartbeat reports."""

    role: Role
    running: int
    queued: int
    l1_used_tokens: int
    l2_used_tokens: int


class BackendUnavailable(RuntimeError):
    """The engine cannot be reached or started; the message is one line for the operator."""


@runtime_checkable
class PeerView(Protocol):
    """Another node as a backend may see it (its KV per the directory)."""

    id: NodeId
    status: str

    def kv_arrived(self, job: DecodeJob) -> None: ...


class WorkerHost(Protocol):
    """What a backend gets from the worker."""

    now: float  # model time of the input or callback being handled

    def emit(self, event: Event) -> None: ...

    def token(self, msg: TokenMsg) -> None: ...

    def schedule(self, t: float, fn, *args) -> None: ...

    def choose_eviction(self, node: NodeId, tier: Tier, tokens: int, pinned: frozenset) -> list[BlockHash]: ...

    def peer(self, node: NodeId) -> PeerView | None: ...


@runtime_checkable
class EngineBackend(Protocol):
    """One engine node behind the worker (module docstring)."""

    name: str  # "sim" | "sglang" | "vllm"
    node_id: NodeId

    @property
    def role(self) -> Role: ...

    async def start(self) -> None:
        """Launch or attach; raises :class:`BackendUnavailable` with one line when it cannot."""

    async def close(self) -> None: ...

    def enqueue_prefill(self, job: PrefillJob) -> None: ...

    def remove_queued(self, request: RequestId) -> PrefillJob | None: ...

    def cancel(self, request: RequestId) -> bool: ...

    def kv_arrived(self, job: DecodeJob) -> None: ...

    def order_switch(self, to_role: Role, mechanism: SwitchMechanism) -> None: ...

    def progress(self) -> None: ...

    def load(self) -> NodeLoad: ...

    def queued(self) -> list[RequestId]: ...
