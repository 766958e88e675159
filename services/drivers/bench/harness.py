"""Small synthetic harness traffic for tests and ``evolving bench live``: nodes, branches and
requests whose prompts share prefixes inside a branch (each request extends its branch's
context), with deterministic ids and block hashes."""

from __future__ import annotations

from events.catalog import BranchOpened, Event, NodeRegistered, RequestSubmitted


def nodes(n_prefill: int = 2, n_decode: int = 2, ts: float = 0.0, src: str = "harness") -> list[Event]:
    out: list[Event] = []
    for i in range(n_prefill):
        out.append(NodeRegistered(ts=ts, src=src, node=f"p{i}", role="prefill",
                                  l1_capacity_tokens=1 << 22, l2_capacity_tokens=1 << 24))
    for i in range(n_decode):
        out.append(NodeRegistered(ts=ts, src=src, node=f"d{i}", role="decode",
                                  l1_capacity_tokens=1 << 22, l2_capacity_tokens=1 << 24))
    return out


def branch_events(branch: int, n_requests: int, ts: float = 0.0, dt: float = 0.01,
                  blocks_per_request: int = 4, prefix: str = "b", src: str = "harness") -> list[Event]:
    """``BranchOpened`` then ``n_requests`` requests; request k holds ``(k+1) * blocks_per_request``
    blocks, the first ``k * blocks_per_request`` shared with request k-1."""
    bid = f"{prefix}{branch}"
    out: list[Event] = [BranchOpened(ts=ts, src=src, branch=bid, session=bid)]
    base = (branch + 1) * 1_000_003
    for k in range(n_requests):
        blocks = [base * 131 + j for j in range((k + 1) * blocks_per_request)]
        out.append(RequestSubmitted(ts=ts + (k + 1) * dt, src=src, request=f"{bid}/{k}", branch=bid,
                                    blocks=blocks, prompt_tokens=len(blocks) * 64 + 10, max_tokens=16))
    return out
