"""The next turn's KV (docs/simulator.md, "The next turn's KV"): the output
blocks a finishing turn leaves (the simulator's ``+prestage`` and ``+specprefill``) and the
figures' fold of the parts' traffic (replay/sim/figures.py). Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Sequence

from events.catalog import KvFetched, KvMoved, KvStageOrdered, RequestStarted, RequestSubmitted
from replay.traces.format import Compact, End, Request, SessionCursor

#: The id suffix of a speculative prefill request (``+specprefill``: the request ``r`` + suffix
#: is the frontend's speculative prefill after ``r`` finished); figures leave them out.
SPEC_SUFFIX = "~spec"


def output_blocks(cur: SessionCursor, request: str, prompt_blocks: Sequence[int], prompt_tokens: int,
                  output_tokens: int, block_tokens: int) -> list[int]:
    """The full blocks of ``request``'s output that its branch's next prompt keeps: the next
    request of the branch in the trace (no compaction in between) extends the prompt's blocks, and
    its blocks ``[len(prompt_blocks), (prompt + output tokens) // block)`` are then the output's
    (the partial last prompt block completed by the first output tokens included). The trace stands
    in for the engine, which hashes the tokens it generated. An output the next prompt does not keep
    gives none (its KV would never be reused)."""
    n_full = (prompt_tokens + max(0, output_tokens)) // block_tokens
    k = len(prompt_blocks)
    if n_full <= k:
        return []
    head = f"{cur.prefix}{cur.session.id}/"
    if not request.startswith(head):
        return []
    local, _, idx = request[len(head):].rpartition("/")
    try:
        steps, i = cur.session.branch(local).steps, int(idx)
    except (KeyError, ValueError):
        return []
    for st in steps[i + 1:]:
        if isinstance(st, (Compact, End)):
            return []
        if isinstance(st, Request):
            nb = st.blocks
            if len(nb) <= k or list(nb[:k]) != list(prompt_blocks):
                return []
            return list(nb[k:n_full])
    return []


class NextTurn:
    """What the next-turn figures keep (module docstring)."""

    def __init__(self) -> None:
        self.branches: set[str] = set()  # branches with a request submitted
        self.cont: set[str] = set()  # continuation requests
        self.branch_of: dict[str, str] = {}  # request (continuations, spec) -> branch
        self.staged: dict[str, str] = {}  # branch -> node of its last stage order / spec prefill
        self.ttft: list[float] = []
        self.on_staged = self.judged = 0
        self.staged_tokens = self.stage_orders = 0
        self.spec_requests = self.spec_prefilled = self.spec_moved = 0
        self.spec_prompt: dict[str, int] = {}

    def submitted(self, e: RequestSubmitted, f) -> None:
        if e.branch in self.branches:
            if e.ts >= f.warmup_s:
                self.cont.add(e.request)
            self.branch_of[e.request] = e.branch
        else:
            self.branches.add(e.branch)

    def spec_submitted(self, e: RequestSubmitted, f) -> None:
        self.branch_of[e.request] = e.branch
        self.spec_prompt[e.request] = e.prompt_tokens
        if f.warmup_s <= e.ts <= f.end_s:
            self.spec_requests += 1

    def started(self, e: RequestStarted, f) -> bool:
        """A prefill start; False for a speculative prefill (the figures leave it out)."""
        rid = e.request
        branch = self.branch_of.get(rid)
        if rid.endswith(SPEC_SUFFIX):
            if branch is not None:
                self.staged[branch] = e.node
            if f.warmup_s <= e.ts <= f.end_s:
                self.spec_prefilled += max(0, self.spec_prompt.pop(rid, 0) - e.cached_tokens)
            return False
        if branch is not None:
            node = self.staged.pop(branch, None)
            if node is not None and rid in self.cont:
                self.judged += 1
                self.on_staged += node == e.node
        return True

    def moved(self, e: KvMoved, f) -> None:
        if not (f.warmup_s <= e.ts <= f.end_s):
            return
        if e.dst_phase == "prefill" and e.request is None:  # a stage order's move
            self.staged_tokens += len(e.blocks) * f.demand.block_tokens
        elif e.request is not None and e.request.endswith(SPEC_SUFFIX):
            self.spec_moved += len(e.blocks) * f.demand.block_tokens

    def fetched(self, e: KvFetched, f) -> None:
        if f.warmup_s <= e.ts <= f.end_s and e.request.endswith(SPEC_SUFFIX):
            self.spec_moved += len(e.blocks) * f.demand.block_tokens

    def stage_ordered(self, e: KvStageOrdered, f) -> None:
        if e.branch is not None:
            self.staged[e.branch] = e.dst_node
        if f.warmup_s <= e.ts <= f.end_s:
            self.stage_orders += 1
