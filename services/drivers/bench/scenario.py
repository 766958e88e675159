"""Small event-stream builders for router tests and ``evolving bench router``. Pure, no I/O.

Node ids are zero-padded (``p00``, ``p01``, ..., ``d00``) so sorted ids follow creation order.
Block hashes are plain integers: a prefix shared by two prompts is the same list head, which
is all the chained-hash property the router relies on.
"""

from __future__ import annotations

from collections.abc import Iterable

from events.catalog import (
    BranchOpened,
    Event,
    FirstToken,
    KvStored,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)


def prefill_id(i: int) -> str:
    return f"p{i:02d}"


def decode_id(i: int) -> str:
    return f"d{i:02d}"


def register(prefill: int, decode: int, ts: float = 0.0, collocated: int = 0) -> list[Event]:
    """``prefill`` prefill nodes, ``decode`` decode nodes, ``collocated`` collocated nodes."""
    out: list[Event] = [NodeRegistered(ts=ts, node=prefill_id(i), role="prefill") for i in range(prefill)]
    out += [NodeRegistered(ts=ts, node=decode_id(i), role="decode") for i in range(decode)]
    out += [NodeRegistered(ts=ts, node=f"c{i:02d}", role="collocated") for i in range(collocated)]
    return out


def blocks(start: int, n: int) -> list[int]:
    """``n`` distinct block hashes starting at ``start`` (a prompt's block list or a part of it)."""
    return list(range(start, start + n))


def submit(request: str, branch: str, blks: list[int], ts: float, block_tokens: int = 64,
           extra_tokens: int = 0, max_tokens: int = 256) -> RequestSubmitted:
    return RequestSubmitted(ts=ts, request=request, branch=branch, blocks=blks,
                            prompt_tokens=len(blks) * block_tokens + extra_tokens, max_tokens=max_tokens,
                            block_tokens=block_tokens)


def store(node: str, blks: list[int], ts: float, tiers: Iterable[str] = ("L1", "L2")) -> list[Event]:
    """``node`` holds ``blks`` in ``tiers``; L1 then L2 is one write-through ``KvStored``."""
    tiers = tuple(tiers)
    if tiers == ("L1", "L2"):
        return [KvStored(ts=ts, node=node, tier="L1", blocks=blks, write_through=True)]
    return [KvStored(ts=ts, node=node, tier=t, blocks=blks) for t in tiers]


def routed(request: str, prefill: str, decode: str, ts: float, t_c: int = 0, t_uc: int = 0,
           policy: str = "history", branch: str | None = None) -> RouteDecided:
    return RouteDecided(ts=ts, request=request, prefill_node=prefill, decode_node=decode, t_c=t_c,
                        t_uc=t_uc, policy=policy, branch=branch)


def lifecycle(request: str, prefill: str, decode: str, ts: float, prefill_s: float = 0.1,
              output_tokens: int = 1) -> list[Event]:
    """Start, first token and finish of a routed request."""
    return [
        RequestStarted(ts=ts, request=request, node=prefill, phase="prefill"),
        FirstToken(ts=ts + prefill_s, request=request, node=prefill),
        RequestStarted(ts=ts + prefill_s, request=request, node=decode, phase="decode"),
        RequestFinished(ts=ts + prefill_s + 0.01, request=request, node=decode, output_tokens=output_tokens),
    ]


def branch(name: str, ts: float, parent: str | None = None, mode: str = "root") -> BranchOpened:
    return BranchOpened(ts=ts, branch=name, parent=parent, mode=mode)
