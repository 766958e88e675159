"""Chat templates of the gateway: the model's own Jinja template, or the simple built-in one.

- :class:`SimpleTemplate`: ``services.drivers.gateway.tokenizer.render_chat`` (``<|role|>\\n...<|end|>``),
  kept for the byte tokenizer and the simulated engines, whose prompts only need exact lengths
  and prefixes.
- :class:`JinjaTemplate`: the model's ``chat_template`` (``tokenizer.chat_template`` of a GGUF
  file, ``chat_template`` of ``tokenizer_config.json`` or ``chat_template.jinja`` beside it)
  rendered as Hugging Face's ``apply_chat_template`` does: a sandboxed, immutable Jinja
  environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension,
  ``raise_exception``, ``strftime_now`` and a ``tojson`` filter; variables ``messages``,
  ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``, or none),
  ``add_generation_prompt``, ``bos_token``, ``eos_token``.

Messages reach the template validated and with string content (text parts joined, other
parts as ``[<type>]``, as the simple template does: most templates expect a string), with
their ``tool_calls`` and ``tool_call_id``. ``continue_final=True`` (Anthropic's assistant
prefill) renders without the generation prompt and cuts the text right after the last
message's content, as ``continue_final_message`` does in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.drivers.gateway.tokenizer import (
    GENERATION_PROMPT,
    TemplateError,
    checked_messages,
    render_chat,
)


class SimpleTemplate:
    """The built-in template (``render_chat``)."""

    name = "simple"

    def render(self, messages: object, tools: Sequence[dict] | None = None, *, continue_final: bool = False) -> str:
        text = render_chat(messages, tools)
        if continue_final:
            tail = "<|end|>\n" + GENERATION_PROMPT
            assert text.endswith(tail)
            text = text[: -len(tail)]
        return text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class JinjaTemplate:
    """A model's Jinja chat template (module docstring). A template that does not compile is
    a ``ValueError`` naming ``where`` it came from."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", where: str = "chat_template") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _now
        try:
            self._tpl = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"{where}: the chat template does not compile: {exc} (line {exc.lineno})") from None
        self.bos_token, self.eos_token, self.name = bos_token, eos_token, f"jinja:{where}"
        self.source = source  # the tool-call format is read from it (toolcalls.detect)

    def render(self, messages: object, tools: Sequence[dict] | None = None, *, continue_final: bool = False) -> str:
        msgs = _messages(messages)
        fn_tools = [t if t.get("type") == "function" and "function" in t else {"type": "function", "function": t}
                    for t in tools] if tools else None
        try:
            text = self._tpl.render(messages=msgs, tools=fn_tools, add_generation_prompt=not continue_final,
                                    bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError("messages", f"the model's chat template refused these messages: {exc}") from None
        if continue_final:
            last = msgs[-1]["content"]
            at = text.rfind(last) if last else -1
            if at < 0:
                raise TemplateError(f"messages[{len(msgs) - 1}].content",
                                    "the chat template does not render the final message's content, "
                                    "so the response cannot continue it")
            text = text[:at + len(last)]
        return text


def _messages(messages: object) -> list[dict]:
    """The messages as the template sees them (validated as ``render_chat`` does)."""
    out = []
    for m, role, text in checked_messages(messages):
        msg = {"role": role, "content": text}
        for k in ("tool_calls", "tool_call_id", "name"):
            if m.get(k) is not None:
                msg[k] = m[k]
        out.append(msg)
    return out
