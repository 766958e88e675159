"""What the attached engines (vLLM, SGLang) are asked for a request's sampling and stopping, and
how their finish reasons read (engine/backends/attached.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.backend import PrefillJob, Sampling
from engine.backends.attached import finish_of, sampling_params

JOB = PrefillJob(request="r", blocks=[], prompt_tokens=10, max_tokens=50, decode_node="n", fetch_plan=[], enqueued_s=0.0)


def test_a_trace_request_is_greedy_and_runs_to_its_budget():
    assert sampling_params(JOB) == {"ignore_eos": True, "temperature": 0}
    assert sampling_params(replace(JOB, ignore_eos=False)) == {"ignore_eos": False, "temperature": 0}


def test_a_clients_parameters_go_through():
    job = replace(JOB, ignore_eos=False, sampling=Sampling(temperature=0.7, top_p=0.9, top_k=0, seed=5, stop=("END",)))
    assert sampling_params(job) == {"ignore_eos": False, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                                    "stop": ["END"], "seed": 5}
    assert "seed" not in sampling_params(job, seed=False)


@pytest.mark.parametrize(("reason", "ours"), [("stop", "stop"), ({"type": "stop", "matched": 2}, "stop"),
                                              ("length", "length"), ({"type": "length"}, "length"),
                                              ("abort", "length"), (None, "length")])
def test_finish_reasons(reason, ours):
    assert finish_of(reason) == ours


def test_a_constraint_is_passed_in_each_servers_own_fields():
    """vLLM and SGLang enforce a constraint themselves (attached.structured_params): a bare JSON
    schema as it is, a value with a prefix / suffix (a Hermes call) as an xgrammar structural tag."""
    import json

    from engine.backends.attached import structured_params
    from events.catalog import OutputConstraint

    assert structured_params(JOB, "vllm") == {} == structured_params(replace(JOB, sampling=Sampling()), "sglang")
    bare = replace(JOB, sampling=Sampling(constraint=OutputConstraint(json_schema='{"type": "object"}')))
    assert structured_params(bare, "vllm") == {"structured_outputs": {"json": {"type": "object"}}}
    assert structured_params(bare, "sglang") == {"json_schema": '{"type": "object"}'}
    call = replace(JOB, sampling=Sampling(constraint=OutputConstraint(
        json_schema='{"type": "object"}', prefix="<tool_call>\n", suffix="\n</tool_call>")))
    tag = json.loads(structured_params(call, "vllm")["structured_outputs"]["structural_tag"])
    assert tag == {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<tool_call>\n"}, {"type": "json_schema", "json_schema": {"type": "object"}},
        {"type": "const_string", "value": "\n</tool_call>"}]}}
    assert json.loads(structured_params(call, "sglang")["structural_tag"]) == tag
