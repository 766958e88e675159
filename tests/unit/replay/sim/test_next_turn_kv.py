"""The next turn's KV: ``+prestage`` (the router stages a finished turn's
prompt + output KV in the predicted node's host tier) and ``+specprefill`` (Dynamo's
speculative next-turn prefill), on a tiny cluster with hand-made sessions whose next prompt is
the previous prompt + its output + a tool result."""

from __future__ import annotations

import msgspec
import pytest

from engine.profiles import load_profile
from events.catalog import KvMoved, KvStageOrdered, RequestStarted, RequestSubmitted
from replay.sim.figures import SPEC_SUFFIX, compute_metrics
from replay.sim.nextturn import output_blocks
from replay.sim.report import ROWS, table_rows
from replay.sim.simulation import SessionCursor, SimConfig, Simulation
from replay.sim.stacks import get_stack
from replay.traces.format import Branch, Request, Session
from services.drivers.recorder.verify import build_cores, verify_rows

PROFILE = load_profile("gb300-glm52")
BT = PROFILE.block_tokens


def _session(sid: int, turns: int = 5, first: int = 300, output: int = 700, tool: int = 200) -> Session:
    """Turn k's prompt = turn k-1's prompt + its output + a tool result (chained hashes)."""
    h = sid * 1_000_003
    tokens, steps, blocks = first * BT + 10, [], []
    for k in range(turns):
        while len(blocks) < tokens // BT:
            h += 1
            blocks.append(h)
        steps.append(Request(blocks=list(blocks), tail_tokens=tokens - len(blocks) * BT, output_tokens=output,
                             pause_s=0.0 if k == 0 else 5.0, pause_kind="tool"))
        tokens += output + tool
    return Session(id=f"s{sid}", block_tokens=BT, branches=[Branch(id="main", steps=steps)])


SESSIONS = [_session(i) for i in range(3)]


def _run(stack: str, agents: int = 3, nodes: int = 3) -> tuple[Simulation, list]:
    cfg = SimConfig(nodes=nodes, duration_s=120.0, warmup_s=0.0, seed=1, agents=agents, stagger_s=2.0)
    sim = Simulation(PROFILE, get_stack(stack), SESSIONS, cfg)
    log = sim.run().log
    assert sim.directory.anomalies() == {}, stack  # every move reads blocks the source holds
    return sim, log


def _prefill_starts(log) -> dict[str, RequestStarted]:
    return {e.request: e for e in log if type(e) is RequestStarted and e.phase == "prefill"}


def _prompts(log) -> dict[str, RequestSubmitted]:
    return {e.request: e for e in log if type(e) is RequestSubmitted}


def _continuations(log) -> list[str]:
    return [r for r in _prompts(log) if not r.endswith("/0") and not r.endswith(SPEC_SUFFIX)]


def test_output_blocks_are_the_next_prompts_blocks_past_the_prompt():
    s = SESSIONS[0]
    cur = SessionCursor(s, prefix="a0:")
    r0, r1 = s.branches[0].steps[0], s.branches[0].steps[1]
    prompt = len(r0.blocks) * BT + r0.tail_tokens
    out = output_blocks(cur, "a0:s0/main/0", r0.blocks, prompt, r0.output_tokens, BT)
    assert out == r1.blocks[len(r0.blocks):(prompt + r0.output_tokens) // BT] and out
    assert output_blocks(cur, "a0:s0/main/4", s.branches[0].steps[4].blocks, prompt, 700, BT) == []  # last turn


@pytest.mark.parametrize("base", ["evolving-static:2P1D", "static:2P1D"])
def test_prestage_stages_the_output_and_the_continuation_prefills_less(base):
    _, plain = _run(base)
    _, staged = _run(base + "+prestage")
    assert not any(type(e) is KvStageOrdered for e in plain)
    orders = [e for e in staged if type(e) is KvStageOrdered]
    moves = [e for e in staged if type(e) is KvMoved and e.dst_phase == "prefill"]
    assert orders and moves and all(m.dst_tier == "L2" and m.src_phase == "decode" for m in moves)
    p0, p1 = _prefill_starts(plain), _prefill_starts(staged)
    prompts = _prompts(staged)
    conts = [r for r in _continuations(staged) if r in p0 and r in p1]
    assert len(conts) >= 6
    new0 = sum(prompts[r].prompt_tokens - p0[r].cached_tokens for r in conts)
    new1 = sum(prompts[r].prompt_tokens - p1[r].cached_tokens for r in conts)
    # the output of each previous turn (700 tokens: 10 full blocks with the prompt's tail) is
    # no longer recomputed; the tool result (200 tokens) still is
    assert new1 < new0 - 8 * BT * len(conts) // 2
    assert all(p1[r].cached_tokens >= p0[r].cached_tokens for r in conts)
    m0, m1 = compute_metrics(plain, 0.0, 120.0), compute_metrics(staged, 0.0, 120.0)
    assert m1.staged_tokens == sum(len(e.blocks) for e in moves) * BT > 0 and m0.staged_tokens == 0
    assert m1.stage_orders == len(orders) and m1.next_turn_on_staged > 0.5
    assert m1.continuations >= m0.continuations > 0  # faster turns: one more may finish
    assert m1.ttft_cont_p50_s < m0.ttft_cont_p50_s


def test_specprefill_prefills_the_next_prompt_and_figures_leave_it_out():
    _, plain = _run("static:2P1D")
    _, spec = _run("static:2P1D+specprefill")
    specs = [e for e in spec if type(e) is RequestSubmitted and e.request.endswith(SPEC_SUFFIX)]
    assert specs and all(e.max_tokens == 1 for e in specs)
    p0, p1 = _prefill_starts(plain), _prefill_starts(spec)
    prompts = _prompts(spec)
    conts = [r for r in _continuations(spec) if r in p0 and r in p1]
    new0 = sum(prompts[r].prompt_tokens - p0[r].cached_tokens for r in conts)
    new1 = sum(prompts[r].prompt_tokens - p1[r].cached_tokens for r in conts)
    assert new1 < new0
    m0, m1 = compute_metrics(plain, 0.0, 120.0), compute_metrics(spec, 0.0, 120.0)
    assert m1.spec_requests == len([e for e in specs if e.ts <= 120.0]) > 0
    assert m1.spec_prefilled_tokens > 0 and m0.spec_requests == 0
    real = [e for e in spec if type(e) is RequestSubmitted and not e.request.endswith(SPEC_SUFFIX)]
    assert m1.submitted == len(real)  # speculative requests are not the agents' requests
    assert m1.next_turn_on_staged > 0.5


def test_parts_are_deterministic_and_verify_reproduces_every_decision():
    for stack in ("evolving-static:2P1D+prestage", "evolving+prestage"):
        sim, log = _run(stack)
        _, again = _run(stack)
        assert [msgspec.msgpack.encode(e) for e in log] == [msgspec.msgpack.encode(e) for e in again]
        conf = sim.stack.core_config(PROFILE, sim.cfg)
        assert conf["router"]["class"].endswith("PrestageLeastTtftRouter")
        cores = build_cores(conf, ["planner", "router"])
        report = verify_rows(((i + 1, "", e) for i, e in enumerate(log)), cores)
        assert report.ok, report.to_dict()
        assert report.checked["KvStageOrdered"] == sum(type(e) is KvStageOrdered for e in log) > 0


def test_a_stack_without_the_part_is_built_as_before():
    for name in ("evolving", "dynamo", "static:2P1D", "evolving-lru"):
        plain = get_stack(name)
        assert not plain.prestage and not plain.specprefill
        assert "prestage" not in plain.describe() and "specprefill" not in plain.describe()
        conf = plain.core_config(PROFILE, SimConfig(nodes=3))
        assert "Prestage" not in conf["router"]["class"]
    with pytest.raises(KeyError, match="no prestaging variant"):
        get_stack("static:2P1D+sticky+prestage").core_config(PROFILE, SimConfig(nodes=3))


def test_the_table_shows_the_next_turn_rows_only_beside_a_stack_with_a_part():
    _, plain = _run("static:2P1D")
    _, spec = _run("static:2P1D+specprefill")
    m0, m1 = compute_metrics(plain, 0.0, 120.0, "a"), compute_metrics(spec, 0.0, 120.0, "b")
    labels = [r[0] for r in table_rows([m0])]
    assert "continuation TTFT P50 (s)" not in labels and [x for x, *_ in ROWS] == labels[:len(ROWS)]
    rows = {r[0]: r for r in table_rows([m0, m1])}
    assert rows["continuation TTFT P50 (s)"][1] == f"{m0.ttft_cont_p50_s:.3f}"
    assert rows["spec prefill computed (tokens)"][2] == str(m1.spec_prefilled_tokens)
