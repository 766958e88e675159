"""The event catalog: every fact and decision on the stream, as msgspec Structs.

Rules (schema evolution, see docs/events.md):
- Structs are ``frozen=True, kw_only=True`` and tagged by class name in the field ``type``.
- Every event carries ``ts`` (seconds, from the publisher's clock or the simulator's virtual
  clock) and ``src`` (publisher id). The stream sequence number is the event's identity.
- New fields are appended with defaults; a tag is never renamed and a type never changed.
  Breaking changes bump ``SCHEMA_MAJOR`` in ``events.codec``.
"""

from __future__ import annotations

from typing import Union

import msgspec

from events.ids import (
    BranchId,
    BranchMode,
    NodeId,
    Phase,
    RequestId,
    Role,
    SwitchMechanism,
    Tier,
    WireBlockHash,
)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True, gc=False):
    """Base of every event: when (``ts``, seconds) and who published it (``src``)."""

    ts: float
    src: str = ""


# --------------------------------------------------------------------------- harness signals
class BranchOpened(Event, frozen=True, kw_only=True, gc=False):
    """A branch (unit of context with its own request sequence) starts.

    ``mode`` is ``root`` for a new agent session, ``fork`` for a branch that reuses its
    parent's context, ``subagent`` for a branch with a fresh context.
    """

    branch: BranchId
    parent: BranchId | None = None
    mode: BranchMode = "root"
    session: str = ""


class OutputConstraint(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a request's output must be (schema 1.4): ``prefix``, then one JSON value
    valid against ``json_schema`` (a JSON Schema, as JSON text), then ``suffix``; the output ends
    there. The gateway builds it from a forcing ``tool_choice`` (the call in the tool-call
    format it parses, e.g. ``<tool_call>\\n`` ... ``\\n</tool_call>``) or a ``response_format`` /
    ``text.format`` JSON schema, and has checked that the schema compiles (docs/gateway.md,
    "Structured output"); an engine enforces it (docs/engines.md, "Structured output")."""

    json_schema: str
    prefix: str = ""
    suffix: str = ""


class RequestSubmitted(Event, frozen=True, kw_only=True, gc=False):
    """A request of a branch arrives at the gateway (or the trace driver).

    ``blocks`` are the chained hashes of the prompt's full blocks of ``block_tokens`` tokens;
    ``prompt_tokens - len(blocks) * block_tokens`` tokens form the partial tail block.
    ``max_tokens`` is the output budget; the trace simulator generates exactly this many
    tokens, so a trace's recorded output length goes here. A live engine ends the output earlier
    at end of turn (a real model's EOS; the sim engine's drawn length,
    engine/backends/sim/lengths.py) when ``ignore_eos`` is false, as the gateway sets it unless
    a client asks for true (benchmarks, replays through the gateway); absent (a trace driver,
    whose ``max_tokens`` is the recorded length) leaves it to the engine: the sim engine runs to
    ``max_tokens``, the torch engine follows its ``--torch-ignore-eos``. ``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop`` (strings that end
    the output) are the client's sampling parameters, absent when not sent (greedy, no stop).
    ``constraint`` (schema 1.4) is what the output must be (:class:`OutputConstraint`), absent
    when the client asked for free text.
    ``priority`` and ``osl`` are the harness's ``nvext.agent_hints`` (absent when not sent):
    a higher ``priority`` is served earlier in a node's prefill queue; ``osl`` is the expected
    output length, which the router and the planner use instead of ``max_tokens`` (capped by it)
    where they estimate decode work (:meth:`expected_output_tokens`).
    """

    request: RequestId
    branch: BranchId
    version: int = 0
    blocks: list[WireBlockHash] = []
    prompt_tokens: int = 0
    max_tokens: int = 0
    block_tokens: int = 64
    # Appended with msgspec's UNSET default, so a payload without the hint is
    # byte-identical to one written before the fields existed (the pinned replay log stays put).
    priority: int | msgspec.UnsetType = msgspec.UNSET
    osl: int | msgspec.UnsetType = msgspec.UNSET
    # Appended (schema 1.3), UNSET when the client did not send them: how the engine
    # samples and where the output ends (docs/engines.md, "Sampling and stopping").
    ignore_eos: bool | msgspec.UnsetType = msgspec.UNSET
    temperature: float | msgspec.UnsetType = msgspec.UNSET
    top_p: float | msgspec.UnsetType = msgspec.UNSET
    top_k: int | msgspec.UnsetType = msgspec.UNSET
    seed: int | msgspec.UnsetType = msgspec.UNSET
    stop: list[str] | msgspec.UnsetType = msgspec.UNSET
    # Appended (schema 1.4), UNSET unless the client forced a tool call or asked for JSON.
    constraint: OutputConstraint | msgspec.UnsetType = msgspec.UNSET

    def expected_output_tokens(self) -> int:
        """The output length to plan for: ``osl`` when the harness sent one (at most
        ``max_tokens`` when that is set), else ``max_tokens``."""
        osl = self.osl
        if isinstance(osl, int) and osl > 0:
            return min(osl, self.max_tokens) if self.max_tokens > 0 else osl
        return self.max_tokens

    def queue_priority(self) -> int:
        """``priority`` (0 when absent): higher is served earlier."""
        return self.priority if isinstance(self.priority, int) else 0


class ContextCompacted(Event, frozen=True, kw_only=True, gc=False):
    """The harness rewrote a branch's context (``version`` is the new, bumped version)."""

    branch: BranchId
    version: int
    blocks: list[WireBlockHash] = []


class BranchEnded(Event, frozen=True, kw_only=True, gc=False):
    """A branch finished; no further request will reference it.

    ``reason`` is absent when the harness ended the branch (an end header, a one-request
    branch); ``idle`` when the gateway expired it after ``--branch-ttl-s`` without a request.
    """

    branch: BranchId
    # Appended with msgspec's UNSET default: absent from payloads that do not set it.
    reason: str | msgspec.UnsetType = msgspec.UNSET


class RequestCancelled(Event, frozen=True, kw_only=True, gc=False):
    """The client of ``request`` (of ``branch``) went away or the gateway gave up on it: nobody
    reads its output any more (schema 1.2).

    Published once by the gateway on the branch's agent subject. ``reason``:
    ``client_disconnected`` (the connection closed before the response ended), ``timeout`` (no
    token within the gateway's ``token_timeout_s``), ``route_timeout`` (no route within
    ``route_timeout_s``), ``gateway_error``, ``gateway_stopping`` (the gateway stops with it in
    flight). The engine holding the request stops it (a queued prefill is dropped,
    a running decode stops at its next iteration boundary) and reports
    ``RequestFinished(error="cancelled")``, which closes the request in every core; the cancel
    itself changes no core's state (docs/gateway.md, "Cancellation").
    """

    request: RequestId
    branch: BranchId
    reason: str = "client_disconnected"


# --------------------------------------------------------------------------- KV facts
class KvStored(Event, frozen=True, kw_only=True, gc=False):
    """``node`` now holds ``blocks`` in ``tier``. ``request``/``branch`` name the producer if known.

    ``write_through`` (schema 1.1), only with ``tier`` L1: the blocks were written to
    L1 and through to L2, one event for what earlier producers sent as two, ``KvStored`` L1 then
    ``KvStored`` L2 with the same ``ts``, blocks, request and branch; it folds exactly as that pair
    (:meth:`tiers`, in order). Logs written before hold the pairs and replay unchanged. Absent
    when only ``tier`` was written (``false`` reads the same); ignored with ``tier`` L2.
    """

    node: NodeId
    tier: Tier
    blocks: list[WireBlockHash] = []
    request: RequestId | None = None
    branch: BranchId | None = None
    # Appended with msgspec's UNSET default: a single-tier store's payload is
    # byte-identical to one written before the field existed.
    write_through: bool | msgspec.UnsetType = msgspec.UNSET

    def tiers(self) -> tuple[Tier, ...]:
        """The tiers the blocks landed in, in the order they are folded: ``(L1, L2)`` for a
        write-through store, else ``(tier,)``."""
        return ("L1", "L2") if self.write_through is True and self.tier == "L1" else (self.tier,)


class KvEvicted(Event, frozen=True, kw_only=True, gc=False):
    """``node`` dropped ``blocks`` from ``tier``."""

    node: NodeId
    tier: Tier
    blocks: list[WireBlockHash] = []


class KvMoved(Event, frozen=True, kw_only=True, gc=False):
    """KV copied from ``src_node`` to ``dst_node`` (the source keeps its copy).

    Within a phase (P2P, D2D) the active-branch count follows the copy to the destination;
    across phases (P2D, D2P) both copies keep it (METHOD.md §4.1).
    """

    src_node: NodeId
    dst_node: NodeId
    blocks: list[WireBlockHash] = []
    src_phase: Phase = "prefill"
    dst_phase: Phase = "decode"
    dst_tier: Tier = "L1"
    request: RequestId | None = None
    branch: BranchId | None = None


class KvFetched(Event, frozen=True, kw_only=True, gc=False):
    """A queued request's KV was fetched from a peer's host memory (L2) to ``dst_node``."""

    request: RequestId
    src_node: NodeId
    dst_node: NodeId
    blocks: list[WireBlockHash] = []
    duration_s: float = 0.0
    hidden_s: float = 0.0  # part of the fetch that overlapped the queue wait


# --------------------------------------------------------------------------- engine facts
class NodeRegistered(Event, frozen=True, kw_only=True, gc=False):
    """An engine joined the partition with its role and capacities. ``transfer_endpoint`` is
    where peers read and write its KV bytes (empty: the node moves no bytes)."""

    node: NodeId
    role: Role
    gpus: int = 4
    l1_capacity_tokens: int = 0
    l2_capacity_tokens: int = 0
    prefill_token_budget: int = 16384
    max_running_requests: int = 256
    t_fwd: float = 1.0  # tokens each request feeds per decode iteration (>1 with speculation)
    profile: str = ""
    # Where peers reach this node's KV bytes (``--kv-bytes``: engine/kvplane.py), e.g.
    # ``"mooncake://127.0.0.1:15578;ctl=127.0.0.1:40123"``; empty when the node moves no bytes.
    transfer_endpoint: str = ""


class NodeHeartbeat(Event, frozen=True, kw_only=True, gc=False):
    """Periodic liveness and load report of an engine.

    Progress (0 from earlier producers): ``applied_seq`` is the stream
    sequence the engine's view has folded, ``published`` the events it has published, and
    ``loop_lag_s`` how long its main loop has kept a probe waiting (the heartbeat comes from a
    thread of its own, so a heartbeat alone no longer proves the loop runs). The liveness
    watcher (services/cores/liveness.py) takes a heartbeat as life at ``ts`` when the engine
    progressed since its previous one or its loop is not late, else at ``ts - loop_lag_s``.
    """

    node: NodeId
    role: Role
    running: int = 0
    queued: int = 0
    l1_used_tokens: int = 0
    l2_used_tokens: int = 0
    applied_seq: int = 0
    published: int = 0
    loop_lag_s: float = 0.0


class NodeRemoved(Event, frozen=True, kw_only=True, gc=False):
    """A node left the partition (shut down, or missed its heartbeats); its KV is gone."""

    node: NodeId
    reason: str = ""


class IterationDone(Event, frozen=True, kw_only=True, gc=False):
    """One scheduler iteration of ``phase`` on ``node`` finished.

    Prefill: ``sum_t_uc`` new tokens, ``sum_A`` query-key pairs, ``sum_t_rst`` tokens restored
    from host memory, ``sum_t_c`` cached tokens. Decode: ``batch`` running requests,
    ``t_fwd`` tokens fed per request, ``accepted_tokens`` tokens emitted in total; ``sum_t_c``
    the context tokens the batch attends over, where the engine measures it (the torch engine;
    the simulator leaves it 0). The planner's eq. 2 does not read it; the dense-decode context
    term of ``evolving bench planner --engine torch`` does.
    """

    node: NodeId
    phase: Phase
    duration_s: float
    batch: int = 0
    sum_t_uc: int = 0
    sum_A: float = 0.0
    sum_t_rst: int = 0
    sum_t_c: int = 0
    t_fwd: float = 1.0
    accepted_tokens: int = 0
    queued: int = 0
    # Consecutive iterations this event stands for (same node, phase, batch; each took
    # ``duration_s`` and accepted ``accepted_tokens`` on average): the simulator reports a run
    # of identical decode iterations as one event. Sums over time weigh by ``iterations``.
    iterations: int = 1


class RequestStarted(Event, frozen=True, kw_only=True, gc=False):
    """``request`` entered the running batch of ``phase`` on ``node``."""

    request: RequestId
    node: NodeId
    phase: Phase
    # Prefill only, what the engine actually found (the router's t_c is a plan): prompt tokens
    # whose KV was reused, of which restored from own host memory / fetched from a peer.
    cached_tokens: int = 0
    restored_tokens: int = 0
    fetched_tokens: int = 0


class FirstToken(Event, frozen=True, kw_only=True, gc=False):
    """The first output token of ``request`` was produced (ends prefill)."""

    request: RequestId
    node: NodeId


class RequestFinished(Event, frozen=True, kw_only=True, gc=False):
    """``request`` finished decoding on ``node`` (or failed: ``error`` set)."""

    request: RequestId
    node: NodeId
    output_tokens: int = 0
    error: str = ""


# --------------------------------------------------------------------------- decisions
class FetchStep(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Fetch ``n_blocks`` blocks of the request, starting at index ``first_block`` of its
    block list, from ``src_node``'s ``tier``."""

    src_node: NodeId
    first_block: int
    n_blocks: int
    tier: Tier = "L2"


class NodeScore(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One candidate node's score in a routing decision (lower is better for our router)."""

    node: NodeId
    score: float
    t_c: int = 0
    queue_s: float = 0.0
    fetch_excess_s: float = 0.0


class RouteDecided(Event, frozen=True, kw_only=True, gc=False):
    """The router placed ``request``: prefill on ``prefill_node``, decode on ``decode_node``.

    ``t_c``/``t_uc`` are cached/uncached prompt tokens at the chosen node after the planned
    ``fetch_plan``; ``scores`` explain the choice; ``reroute`` marks a move of a queued
    request off a node that is switching role.
    """

    request: RequestId
    prefill_node: NodeId
    decode_node: NodeId
    t_c: int = 0
    t_uc: int = 0
    fetch_plan: list[FetchStep] = []
    predicted_ttft_s: float = 0.0
    policy: str = ""
    scores: list[NodeScore] = []
    reroute: bool = False
    branch: BranchId | None = None
    shadow: bool = False  # decided by a router in shadow: nobody acts on it


class ModelFitted(Event, frozen=True, kw_only=True, gc=False):
    """Iteration-time model of ``phase`` on ``node`` fitted by NNLS.

    Prefill: ``[c0, c1, c2, c3]`` for eq. 1; decode: ``[d0, d1, d2, d3]`` for eq. 2 and its
    context term ``d3`` (seconds per context token the batch attends over; logs written before
    it carry three).
    ``mape`` is the mean absolute percentage error on held-back samples.
    """

    node: NodeId
    phase: Phase
    coefficients: list[float] = []
    samples: int = 0
    mape: float = 0.0


class Split(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    prefill: int
    decode: int


class Candidate(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One candidate split evaluated over a planning window."""

    split: Split
    mean_gain: float
    se: float
    throughput: float = 0.0
    predicted_ttft_p95_s: float = 0.0
    passed: bool = False
    veto: str = ""
    # Appended (schema 1.6), UNSET unless a backlog was measured (``Backlog``):
    # the P95 TTFT the decision used, the prediction's or the measured backlog's wait plus the
    # predicted prefill latency, whichever is larger; and the throughput with the queued requests
    # counted in the decode population (deferred decode work; the SLO escape's tolerance)
    measured_ttft_p95_s: float | msgspec.UnsetType = msgspec.UNSET
    throughput_with_queue: float | msgspec.UnsetType = msgspec.UNSET


class ShiftTest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The change-point test that opened a planner decision between window ends:
    ``signal``'s mean over the last ``n_recent`` slices (``recent``) against the ``n_older``
    slices before them in the sliding window (``older``); shifted when ``recent - older`` exceeds
    twice ``se``, the Welch standard error of that difference."""

    signal: str
    recent: float
    older: float
    se: float
    n_recent: int
    n_older: int


class Backlog(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The prefill backlog a planner decision measured over its last ``n_slices`` slices (issue
    41 part 1), every one with a queue: the mean ``queue`` (requests waiting for prefill) and the
    last slice's ``last_queue`` (the backlog a request arriving now waits behind), the
    ``arrivals_rps`` and Little's mean ``wait_s = queue / arrivals_rps``; ``served_rps``
    prefilled, ``node_rps`` per busy prefill node, ``growth_rps`` of the queue and the
    ``demand_rps`` they imply; ``wait_p95_s``: the P95 prefill-queue wait of the requests whose
    prefill started in the slices, ``spread`` its ratio to their mean wait (at least 1);
    ``need_prefill``: the fewest prefill nodes whose measured capacity serves the demand and
    drains the backlog within ``horizon_s``, its P95 wait within ``horizon_s`` too."""

    queue: float
    last_queue: float
    arrivals_rps: float
    wait_s: float
    served_rps: float
    node_rps: float
    growth_rps: float
    demand_rps: float
    wait_p95_s: float = 0.0
    spread: float = 1.0
    horizon_s: float
    need_prefill: int
    n_slices: int


class PlanEvaluated(Event, frozen=True, kw_only=True, gc=False):
    """The planner compared candidate splits at the end of a window, or (``shift`` set) at a
    slice end where the mix had shifted (``window_start``/``window_end`` then span the recent
    slices the candidates were evaluated over). ``backlog`` (set when a prefill queue waited
    in each of the last slices) is the measured backlog the decision read beside the
    predictions."""

    window_start: float
    window_end: float
    current: Split
    candidates: list[Candidate] = []
    chosen: Split | None = None
    reason: str = ""
    planner: str = ""
    # Appended (schema 1.5), UNSET on window-end decisions, so their payload is
    # byte-identical to 1.4: the change-point test of a decision taken on the shift path
    shift: ShiftTest | msgspec.UnsetType = msgspec.UNSET
    # Appended (schema 1.6), UNSET when no backlog was measured (no sustained
    # prefill queue), so such payloads are byte-identical to 1.5
    backlog: Backlog | msgspec.UnsetType = msgspec.UNSET


class RoleSwitchOrdered(Event, frozen=True, kw_only=True, gc=False):
    """The planner decided that ``node`` changes role to ``to_role``."""

    node: NodeId
    from_role: Role
    to_role: Role
    mechanism: SwitchMechanism = "in_place"
    reason: str = ""


class AnomalyReported(Event, frozen=True, kw_only=True, gc=False):
    """A consumer met input that violates an invariant (unknown branch, unknown block, ...).

    Counted and reported, never fatal. ``ref`` names the offending entity.
    """

    component: str
    kind: str
    ref: str = ""
    detail: str = ""


class KvStageOrdered(Event, frozen=True, kw_only=True, gc=False):
    """Decision (router): during the tool wait after ``request`` finished,
    stage its KV (prompt + output, held by its decode node ``src_node``) into ``dst_node``'s
    ``tier``, the node the router predicts for the branch's next turn. The destination pulls
    what it lacks over its fetch link and reports ``KvMoved(src_phase=decode,
    dst_phase=prefill, dst_tier=tier, branch=...)`` for what landed (nothing if the source no
    longer holds it). Published on ``ei.<p>.route`` with the router's other decisions."""

    request: RequestId
    src_node: NodeId
    dst_node: NodeId
    branch: BranchId | None = None
    tier: Tier = "L2"
    predicted_ttft_s: float = 0.0
    policy: str = ""


# --------------------------------------------------------------------------- commands and acks
class SwitchRole(Event, frozen=True, kw_only=True, gc=False):
    """Command (on ``ei.<partition>.cmd.<node>``): drain and change role."""

    node: NodeId
    to_role: Role
    mechanism: SwitchMechanism = "in_place"


class RoleSwitched(Event, frozen=True, kw_only=True, gc=False):
    """Ack: ``node`` now serves ``role``; ``drained`` requests finished during the switch."""

    node: NodeId
    role: Role
    drained: int = 0
    duration_s: float = 0.0
    kv_dropped: bool = False
    #: How the switch was really carried out when it differs from the order (an engine that
    #: cannot switch in place: ``restart``, ``in_place_drop_kv``; ``refused``); "" = as ordered.
    mechanism: str = ""


# --------------------------------------------------------------------------- clock
class Tick(Event, frozen=True, kw_only=True, gc=False):
    """Clock tick published by the planner adapter or the simulator: planning windows and
    timeouts close on ticks so a replay sees the same time."""


AnyEvent = Union[  # noqa: UP007 - a typing.Union alias: msgspec and get_args() read it the same on 3.11
    BranchOpened,
    RequestSubmitted,
    ContextCompacted,
    BranchEnded,
    KvStored,
    KvEvicted,
    KvMoved,
    KvFetched,
    NodeRegistered,
    NodeHeartbeat,
    NodeRemoved,
    IterationDone,
    RequestStarted,
    FirstToken,
    RequestFinished,
    RouteDecided,
    ModelFitted,
    PlanEvaluated,
    RoleSwitchOrdered,
    AnomalyReported,
    SwitchRole,
    RoleSwitched,
    Tick,
    KvStageOrdered,
    RequestCancelled,
]

EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__  # type: ignore[attr-defined]
EVENT_BY_NAME: dict[str, type[Event]] = {t.__name__: t for t in EVENT_TYPES}
