"""A logging reverse proxy for the real-client tests: it sits between an agent
client (Claude Code, Codex, opencode, mini-swe-agent) and the gateway, forwards every request
unchanged, streams the answer back as it comes, and records what the client sent - method, path,
query, headers without secrets, the body (parsed when it is JSON) and its size - with the
gateway's status, and the answer's body when that status is an error.

In a test: ``with LoggingProxy(upstream) as proxy:`` - the client gets ``proxy.url``, the test
reads ``proxy.records``. By hand, to see what a client sends::

    python -m tests.integration.logging_proxy --upstream http://127.0.0.1:8000 --port 8100 --log cc.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

import aiohttp
from aiohttp import web

#: Headers whose values never reach the log (the name stays, the value is replaced).
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization",
                            "openai-api-key", "anthropic-api-key"})
#: Hop-by-hop headers a proxy does not forward (RFC 9110 7.6.1), plus the ones aiohttp sets itself.
#: The gateway's answer headers a record keeps: which request and branch the gateway made of it.
REPLY_HEADERS = ("x-request-id", "x-branch-id", "x-evolving-unapplied", "x-evolving-unserved-tools")
HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                 "upgrade", "host", "content-length"})


@dataclass
class Record:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body_bytes: int
    body: object  # parsed JSON, the text, or None
    status: int = 0
    error_body: str | None = None  # the gateway's answer when status >= 400
    reply_headers: dict[str, str] = field(default_factory=dict)  # the gateway's ids (REPLY_HEADERS)
    extra: dict = field(default_factory=dict)

    @property
    def json(self) -> dict:
        return self.body if isinstance(self.body, dict) else {}


@dataclass
class Scripted:
    """A reply the proxy gives in place of the gateway's (``LoggingProxy(script=...)``)."""
    body: bytes
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


def anthropic_tool_use(model: str, tool: str, tool_input: dict, tool_id: str = "toolu_scripted_1") -> Scripted:
    """A streamed Messages API turn that is one ``tool_use`` block (Anthropic's event sequence)."""
    def ev(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
    usage = {"input_tokens": 1, "output_tokens": 1}
    body = "".join([
        ev("message_start", {"message": {"id": "msg_scripted", "type": "message", "role": "assistant", "model": model,
                                         "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}),
        ev("content_block_start", {"index": 0, "content_block": {"type": "tool_use", "id": tool_id, "name": tool,
                                                                  "input": {}}}),
        ev("content_block_delta", {"index": 0, "delta": {"type": "input_json_delta",
                                                         "partial_json": json.dumps(tool_input)}}),
        ev("content_block_stop", {"index": 0}),
        ev("message_delta", {"delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 1}}),
        ev("message_stop", {}),
    ])
    return Scripted(body.encode(), headers={"content-type": "text/event-stream", "cache-control": "no-cache"})


def openai_tool_call(model: str, name: str, arguments: dict, call_id: str = "call_scripted_1") -> Scripted:
    """A streamed chat completion that is one tool call (OpenAI's chunks, a usage chunk, ``[DONE]``)."""
    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
        body = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"
    call = {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    body = "".join([chunk({"role": "assistant", "content": None, "tool_calls": [call]}), chunk({}, "tool_calls"),
                    chunk({}, usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}),
                    "data: [DONE]\n\n"])
    return Scripted(body.encode(), headers={"content-type": "text/event-stream", "cache-control": "no-cache"})


def responses_function_call(model: str, name: str, arguments: dict, call_id: str = "call_scripted_1",
                            namespace: str | None = None) -> Scripted:
    """A streamed Responses API turn that is one ``function_call`` item (``namespace``: a tool of
    a namespace tool, as Codex names its sub-agent tools)."""
    def ev(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
    item = {"id": "fc_" + call_id, "type": "function_call", "status": "completed", "call_id": call_id,
            "name": name, "arguments": json.dumps(arguments)}
    if namespace is not None:
        item["namespace"] = namespace
    resp = {"id": "resp_scripted", "object": "response", "created_at": 0, "status": "completed", "model": model,
            "output": [item], "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}
    body = "".join([ev("response.created", response={**resp, "status": "in_progress", "output": []}),
                    ev("response.output_item.added", output_index=0, item={**item, "status": "in_progress"}),
                    ev("response.output_item.done", output_index=0, item=item),
                    ev("response.completed", response=resp)])
    return Scripted(body.encode(), headers={"content-type": "text/event-stream", "cache-control": "no-cache"})


def _redact(headers) -> dict[str, str]:
    return {k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def _parse(raw: bytes) -> object:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


class LoggingProxy:
    """The proxy on a loopback port, served by its own event loop in a thread, so a synchronous
    test can run a client as a child process beside it."""

    def __init__(self, upstream: str, port: int = 0, log_path: str | Path | None = None,
                 script: Callable[[Record], Scripted | None] | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        # ``script(record)``: a reply the client gets instead of the gateway's (a scripted model
        # turn, e.g. a tool call the sim engine would never write); the request still goes to the
        # gateway, whose answer is read to its end and kept in ``record.extra["upstream"]``
        self.script = script
        self.port = port
        self.log_path = Path(log_path) if log_path else None
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- the proxy ---------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rec = Record(method=request.method, path=request.path, query=request.query_string,
                     headers=_redact(request.headers), body_bytes=len(raw), body=_parse(raw))
        with self._lock:
            self.records.append(rec)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        assert self._session is not None
        try:
            upstream = await self._session.request(request.method, self.upstream + request.path_qs,
                                                   data=raw if raw else None, headers=headers,
                                                   allow_redirects=False)
        except aiohttp.ClientError as e:
            rec.status = 502
            rec.error_body = f"proxy: {e!r}"
            self._append(rec)
            return web.json_response({"error": {"message": f"proxy: {e}"}}, status=502)
        rec.status = upstream.status
        rec.reply_headers = {h: upstream.headers[h] for h in REPLY_HEADERS if h in upstream.headers}
        scripted = self.script(rec) if self.script is not None and upstream.status < 400 else None
        if scripted is not None:
            async with upstream:
                rec.extra["upstream"] = (await upstream.read()).decode("utf-8", "replace")
            rec.extra["scripted"] = True
            self._append(rec)
            return web.Response(status=scripted.status, body=scripted.body, headers=scripted.headers)
        async with upstream:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP:
                    out.headers[k] = v
            await out.prepare(request)
            first = b""
            try:
                async for chunk in upstream.content.iter_any():
                    if upstream.status >= 400 and len(first) < 65_536:
                        first += chunk
                    await out.write(chunk)
            except (aiohttp.ClientError, ConnectionResetError) as e:
                rec.extra["stream_error"] = repr(e)
            if upstream.status >= 400:
                rec.error_body = first.decode("utf-8", "replace")
            self._append(rec)
            try:
                await out.write_eof()
            except ConnectionResetError:
                rec.extra["client_gone"] = True
            return out

    def _append(self, rec: Record) -> None:
        if self.log_path is None:
            return
        with self._lock, self.log_path.open("a") as f:
            f.write(json.dumps(asdict(rec)) + "\n")

    # -- lifecycle ---------------------------------------------------------------------------
    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                                              auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._start())
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            self._failed = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._stop())
        loop.close()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, name="logging-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._failed is not None:
            raise self._failed
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # -- reading the log ---------------------------------------------------------------------
    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def errors(self) -> list[Record]:
        return [r for r in self.snapshot() if r.status >= 400]


def prompt_tokens(path: str, body: dict, model) -> int:
    """The prompt tokens the gateway makes of a recorded request body with ``model`` (a
    ``services.drivers.gateway.model.PromptModel``): rendered by the same parser and chat
    template as the gateway's route for ``path``, then encoded."""
    from services.drivers.gateway import anthropic_api, responses_api
    from services.drivers.gateway.api import chat_tools, parse_chat

    raw = json.dumps(body).encode()
    if path.startswith("/v1/messages"):
        text = anthropic_api.render_prompt(anthropic_api.parse_messages(raw, []), model.template)
    elif path == "/v1/responses":
        parsed = responses_api.parse_responses(raw)
        text = model.template.render(responses_api.prompt_messages(parsed, []), parsed.tools)
    elif path == "/v1/chat/completions":
        creq, obj = parse_chat(raw, [])
        text = model.template.render(obj["messages"], chat_tools(creq))
    else:
        raise ValueError(f"not a generation route: {path}")
    return len(model.tokenizer.encode(text))


def measure(log: str, model_path: str | None) -> list[dict]:
    """Per generation request of a proxy log: body bytes, tools (count and bytes), and the
    prompt in tokens as the sim engines' gateway counts them (bytes of the rendered prompt), as
    ``model_path``'s (default: SmolLM2-135M-Instruct, the torch engine's) and the tools' JSON in
    that model's tokens."""
    from engine.model_files import smollm2_gguf
    from services.drivers.gateway.model import load_model

    byte = load_model(None)
    real = load_model(model_path or str(smollm2_gguf()))
    out = []
    for line in Path(log).read_text().splitlines():
        r = json.loads(line)
        body = r["body"] if isinstance(r["body"], dict) else None
        if r["method"] != "POST" or body is None or r["path"] not in (
                "/v1/messages", "/v1/responses", "/v1/chat/completions"):
            continue
        tools = body.get("tools") or []
        out.append({"path": r["path"], "status": r["status"], "body_bytes": r["body_bytes"],
                    "tools": len(tools), "tools_bytes": len(json.dumps(tools)),
                    "max_tokens": body.get("max_tokens", body.get("max_output_tokens")),
                    "sim_tokens": prompt_tokens(r["path"], body, byte),
                    "model_tokens": prompt_tokens(r["path"], body, real),
                    # what a template that writes the tools into the prompt adds (Hermes / Qwen
                    # style: one JSON object a line); SmolLM2's own template leaves them out
                    "tools_model_tokens": sum(len(real.tokenizer.encode(json.dumps(t))) for t in tools)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", required=True, help="JSON lines, one per request")
    ap.add_argument("--measure", action="store_true",
                    help="do not proxy: print the prompt size of each generation request in LOG")
    ap.add_argument("--model", help="with --measure: the tokenizer and template (default: SmolLM2-135M)")
    args = ap.parse_args(argv)
    if args.measure:
        for row in measure(args.log, args.model):
            print(json.dumps(row))
        return
    if not args.upstream:
        ap.error("--upstream is required to proxy")
    with LoggingProxy(args.upstream, args.port, args.log) as proxy:
        print(f"proxy {proxy.url} -> {args.upstream}, log {args.log}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
