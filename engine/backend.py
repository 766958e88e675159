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

import msgspec

from events.catalog import Event, FetchStep, OutputConstraint, RequestSubmitted
from events.ids import BlockHash, NodeId, RequestId, Role, SwitchMechanism, Tier
from events.wire import TokenMsg


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a request's tokens are chosen and where its output ends (its ``RequestSubmitted``'s
    sampling fields; docs/engines.md, "Sampling and stopping"). ``temperature`` 0 is greedy;
    ``top_k`` 0 or -1 is no limit; ``seed`` None draws from the engine's own generator; ``stop``:
    strings that end the output (the stop string itself is not part of it); ``constraint``: what
    the output must be (a forced tool call, a JSON schema; docs/engines.md, "Structured output"),
    None for free text."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: OutputConstraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def request_output(req: RequestSubmitted) -> dict:
    """The job fields (``ignore_eos``, ``osl``, ``sampling``) a ``RequestSubmitted`` sets:
    ``ignore_eos`` None when the publisher did not say, ``sampling`` None when the client sent no
    sampling parameter and no constraint (greedy free text, no stop string)."""
    def get(name, default):
        v = getattr(req, name)
        return default if v is msgspec.UNSET or v is None else v

    sampling = None
    if any(getattr(req, f) is not msgspec.UNSET for f in ("temperature", "top_p", "top_k", "seed", "stop",
                                                          "constraint")):
        sampling = Sampling(temperature=float(get("temperature", 0.0)), top_p=float(get("top_p", 1.0)),
                            top_k=int(get("top_k", 0)), seed=get("seed", None),
                            stop=tuple(s for s in get("stop", ()) if s), constraint=get("constraint", None))
    osl = req.osl if isinstance(req.osl, int) else 0
    ignore = req.ignore_eos if isinstance(req.ignore_eos, bool) else None
    return {"ignore_eos": ignore, "osl": max(0, osl), "sampling": sampling}


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
    # what the request asks of its output (RequestSubmitted): True: generate max_tokens whatever
    # the model says (benchmarks); False: end at end of turn (the gateway says so unless asked);
    # None: not said (a trace driver, whose max_tokens is the recorded length): the engine's
    # default. Then the harness's expected output length (0: none), and how to sample.
    ignore_eos: bool | None = None
    osl: int = 0
    sampling: Sampling | None = None
    output_tokens: int = 0  # the sim node's drawn output length (engine/backends/sim/lengths.py); 0: max_tokens
    est_uc: int = 0  # the sim node's expected new tokens at enqueue (its short_first queue order)


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
    max_tokens: int = 0  # the request's budget (0: total_out); a shorter total_out ends the turn
    ignore_eos: bool | None = None  # as PrefillJob's
    osl: int = 0
    sampling: Sampling | None = None


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
