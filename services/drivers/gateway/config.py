"""The gateway's settings (``GatewayConfig``) and the event clock it stamps events with."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

MiB = 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    partition: str = "default"
    model: str = "evolving-sim"
    # The model names a request may ask for besides ``model`` (--served-model-name); empty: any
    # name is served (a single-model gateway answers whatever name a client was configured with).
    served_model_names: tuple[str, ...] = ()
    block_tokens: int = 64
    # 30 s, not 10: a route crosses JetStream twice (RouteRequested in, RouteDecided out), and a
    # NATS server lost from the cluster stalls both until the stream's and the router consumer's
    # new leaders are elected (4-9 s in nats-server) and found (4.3-8.8 s for a reader in
    # `evolving bench failover`); 10 s turned a failover into 503s (docs/gateway.md)
    route_timeout_s: float = 30.0
    token_timeout_s: float = 60.0
    # a request without a budget: what the context leaves, at most this (0: no further cap) and
    # default_budget_cap; the engine ends the turn long before (docs/gateway.md)
    default_max_tokens: int = 0
    default_budget_cap: int = 65_536
    # the largest budget a request may ask for (and the context must hold it): Claude Code 2.1.332
    # asks 128,000 for its default model, so the cap is the default context, not a smaller number
    max_tokens_limit: int = 262_144
    tokenizer: str | None = None
    src: str = "gateway"
    # Event ts = epoch + (wall - epoch) * time_scale: the scaled clock the sim engines and the
    # planner's ticker share (engine/worker/host.py). 1.0 = wall-clock seconds.
    time_scale: float = 1.0
    clock_epoch: float | None = None
    # Hardening (docs/gateway.md, "Limits and authentication"):
    context_length: int = 262_144  # prompt + completion tokens a request may ask for
    max_body_bytes: int = 8 * MiB  # larger bodies: 413 before a byte of them is read
    api_keys: frozenset[str] = field(default_factory=frozenset)  # empty: no authentication
    # Idle expiry of open branches (docs/gateway.md, "Branch headers"), in event-clock seconds;
    # None or <= 0: never. Harnesses such as Claude Code never send an end.
    branch_ttl_s: float | None = 1800.0
    # The Responses API's stored responses (previous_response_id, GET /v1/responses/{id}; docs/gateway.md,
    # "Responses API"): in memory, least recently used dropped first past either bound, each kept
    # at most responses_ttl_s wall seconds.
    responses_store_entries: int = 1024
    responses_store_mb: int = 64
    responses_ttl_s: float = 3600.0
    # Tool calls in the model's text (docs/gateway.md, "Tool calls"): vLLM's parser names;
    # auto: the one the chat template asks for (toolcalls.detect), none without a model template
    tool_call_parser: str = "auto"


def scaled_clock(time_scale: float, epoch: float | None) -> Callable[[], float]:
    """``epoch + (time.time() - epoch) * time_scale`` (plain ``time.time`` at scale 1)."""
    if time_scale == 1.0:
        return time.time
    e = time.time() if epoch is None else epoch
    return lambda: e + (time.time() - e) * time_scale

