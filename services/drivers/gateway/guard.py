"""Admission from the headers alone and the error shape of every answer (step 0 of app.py's lifecycle).

``Guard`` is the app's middleware and ``Expect: 100-continue`` handler: the API key on ``/v1/*``
(401) and the declared body size (413) before a byte of the body is read; every error, aiohttp's
own 404/405/413 and an unexpected exception (500) included, leaves as OpenAI-style JSON
(Anthropic's shape on ``/v1/messages*``). Once a stream is prepared (``STREAMING``), errors are
events inside it and pass through. A ``RecursionError`` (input nested too deeply for some
recursive step) is the client's 400 ``json_too_deep``, never a 500.

What never reaches the app, a request aiohttp's HTTP parser refuses (a header line over 8 KiB,
a control character in a header value, a bad request line: ``BadHttpMessage``), is answered by
:class:`JsonErrorProtocol` instead of aiohttp's plain text, logged as one warning line without
a traceback, in the shape of the route its request line names. Serve the app with
:class:`GatewayRunner` (``__main__``; the tests' live gateways) to get it.
"""

from __future__ import annotations

import asyncio
import re

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from services.adapters.logging import get_logger
from services.drivers.gateway import anthropic_api
from services.drivers.gateway.api import ApiError, clip, too_deep_error
from services.drivers.gateway.auth import ApiKeys
from services.drivers.gateway.metrics import GatewayMetrics

log = get_logger("gateway")

STREAMING: web.RequestKey[bool] = web.RequestKey("ei_streaming")  # the SSE response is prepared


def error_response(exc: ApiError, headers: dict[str, str] | None = None, path: str = "") -> web.Response:
    """The error as JSON: Anthropic's shape on ``/v1/messages*`` (anthropic_api), else OpenAI's."""
    h = dict(headers or {})
    if exc.status == 401:
        h["WWW-Authenticate"] = "Bearer"
    anthropic = path.startswith(anthropic_api.PREFIX)
    return web.json_response(anthropic_api.error_body(exc) if anthropic else exc.body(), status=exc.status,
                             headers=h)


def _http_error(exc: web.HTTPException, req: web.Request, max_body: int) -> ApiError:
    """aiohttp's own errors (no route, wrong method, body over client_max_size) as OpenAI JSON."""
    method, path = clip(req.method, 32), clip(req.path)
    if exc.status == 404:
        return ApiError(404, f"no such endpoint: {method} {path}", None, code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return ApiError(405, f"method {method} is not allowed on {path} (allowed: {allowed})", None,
                        code="method_not_allowed")
    if exc.status == 413:
        return ApiError(413, f"the request body is larger than the limit of {max_body} bytes (--max-body-mb)",
                        "body", code="request_too_large")
    return ApiError(exc.status, exc.text or exc.reason, None, code=exc.reason.lower().replace(" ", "_"))


class Guard:
    """The checks and the error answers of one app: ``keys`` (empty: no authentication), the
    body limit, and ``metrics`` counting every error answered."""

    def __init__(self, keys: ApiKeys, max_body_bytes: int, metrics: GatewayMetrics) -> None:
        self.keys, self.max_body_bytes, self.metrics = keys, max_body_bytes, metrics

    def admit(self, req: web.Request) -> None:
        """Checks made from the headers alone, before a byte of the body is read: the API key
        (on ``/v1/*``), then the declared body size."""
        if req.path.startswith("/v1/"):
            self.keys.check(req.headers.get("Authorization"), req.headers.get("x-api-key"))
        if req.content_length is not None and req.content_length > self.max_body_bytes:
            raise ApiError(413, f"the request body ({req.content_length} bytes) is larger than the limit of "
                                f"{self.max_body_bytes} bytes (--max-body-mb)", "body",
                           code="request_too_large")

    async def expect(self, req: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: refuse (401/413) before the client sends the body."""
        try:
            self.admit(req)
        except ApiError as exc:
            return self.error(exc, {"Connection": "close"}, req.path)
        if req.headers.get("Expect", "").lower() != "100-continue":
            return self.error(ApiError(417, f"unknown Expect: {clip(req.headers.get('Expect', ''))}", None,
                                        code="expectation_failed"), None, req.path)
        if req.version >= (1, 1):
            await req.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    @web.middleware
    async def middleware(self, req: web.Request, handler) -> web.StreamResponse:
        """Authentication and the body limit first; every error leaves as OpenAI JSON."""
        try:
            self.admit(req)
            return await handler(req)
        except ApiError as exc:
            if req.get(STREAMING):
                raise
            return self.error(exc, None, req.path)
        except web.HTTPException as exc:
            if exc.status < 400 or req.get(STREAMING):
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return self.error(_http_error(exc, req, self.max_body_bytes), allow, req.path)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except RequestPayloadError as exc:  # the body cannot be read: e.g. gzip that does not decompress
            why = getattr(exc.__cause__, "message", None) or str(exc)
            return self.error(ApiError(400, f"the request body could not be read: {clip(why)}", "body",
                                        code="invalid_body"), None, req.path)
        except RecursionError:  # nested input that a recursive step could not take: the client's
            if req.get(STREAMING):
                raise
            log.warning("input_too_deep", path=clip(req.path))
            return self.error(too_deep_error(None), None, req.path)
        except Exception as exc:
            if req.get(STREAMING):
                raise
            log.exception("internal_error", path=clip(req.path), error=clip(str(exc)))
            return self.error(ApiError(500, f"internal error: {type(exc).__name__}", None,
                                        code="internal_error"), None, req.path)

    def error(self, exc: ApiError, headers: dict[str, str] | None = None, path: str = "") -> web.Response:
        self.metrics.inc("ei_gateway_errors_total", status=str(exc.status), code=exc.code)
        return error_response(exc, headers, path)


# ----------------------------------------------------------------------------- protocol errors
#: aiohttp's parser errors (``aiohttp.http_exceptions``) -> our ``code``; any other: ``bad_request``.
PROTOCOL_CODES = {"LineTooLong": "header_too_large", "InvalidHeader": "invalid_header",
                  "BadStatusLine": "bad_request_line", "BadHttpMethod": "bad_request_line",
                  "InvalidURLError": "bad_request_line", "TransferEncodingError": "invalid_body",
                  "ContentLengthError": "invalid_body", "ContentEncodingError": "invalid_body"}
# the start of a request line: where the route is read from before the parser has it
_REQUEST_LINE = re.compile(rb"[A-Z]{3,7} (/[^ ?#\r\n]{0,1024})")


def protocol_error(status: int, exc: BaseException | None, message: str | None) -> ApiError:
    """What aiohttp's ``handle_error`` was given, as our error (the status is aiohttp's)."""
    why = clip(" ".join(str(message or getattr(exc, "message", "") or "").split()))
    if status >= 500:
        return ApiError(status, "internal error: the gateway could not answer this request", None,
                        code="internal_error")
    code = PROTOCOL_CODES.get(type(exc).__name__ if exc is not None else "", "bad_request")
    if code == "bad_request":  # a plain BadHttpMessage: its message says about what
        low = why.lower()
        code = ("invalid_header" if "header" in low or "content-length" in low
                else "invalid_body" if "chunk" in low else code)
    return ApiError(status, f"the HTTP request could not be parsed: {why}" if why else
                    "the HTTP request could not be parsed", None, code=code)


class JsonErrorProtocol(web.RequestHandler):
    """aiohttp's HTTP protocol (one per connection) with its own error answers as JSON.

    ``handle_error`` answers what the parser refused (always a 400 in aiohttp 3.14) and an
    exception that escaped the app (the middleware answers every one it sees, so that is a bug:
    a 500, logged with its traceback as aiohttp does). The parser's error does not say which
    route the request was for, so the path is taken from the request line of the bytes received
    last (``data_received``): Anthropic's shape on ``/v1/messages*``, else OpenAI's."""

    __slots__ = ("_ei_path",)

    def data_received(self, data: bytes) -> None:
        if data[:1].isupper():  # a request line begins here (or a body chunk that starts with a capital)
            m = _REQUEST_LINE.match(data)
            if m is not None:
                self._ei_path = m.group(1).decode("latin-1")
        super().data_received(data)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        err = protocol_error(status, exc, message)
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            kind = type(exc).__name__ if exc is not None else None
            # not HTTP at all (a scanner, TLS on the plain port) is routine: debug, as aiohttp does
            say = log.debug if kind == "BadHttpMethod" else log.warning
            say("http_protocol_error", status=status, code=err.code, error=kind, remote=request.remote,
                path=clip(getattr(self, "_ei_path", "")), detail=err.message)
        if request.writer.output_size > 0:  # a response has begun: the connection can only be cut
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        resp = error_response(err, None, getattr(self, "_ei_path", ""))
        resp.force_close()
        return resp

    def log_exception(self, *args, **kw) -> None:
        """A body that turned out unreadable while aiohttp drained it after the answer (gzip that
        does not decompress, a broken chunk): the client's fault, one warning line; anything
        else as aiohttp logs it (with its traceback)."""
        exc = kw.get("exc_info")
        if isinstance(exc, (RequestPayloadError, HttpProcessingError)):
            log.warning("http_body_unreadable", error=type(exc).__name__,
                        detail=clip(" ".join(str(getattr(exc.__cause__, "message", None) or exc).split())))
            return
        super().log_exception(*args, **kw)


class _JsonErrorServer(web.Server):
    """aiohttp's low-level server, whose connections are :class:`JsonErrorProtocol`."""

    def __call__(self) -> web.RequestHandler:
        return JsonErrorProtocol(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` whose server answers aiohttp's own protocol errors as JSON. (aiohttp has
    no public hook for the protocol class: this takes the server ``AppRunner`` builds and builds
    the same one with :class:`JsonErrorProtocol`; tests/integration/test_gateway_bad_input.py
    fails if a new aiohttp changes that.)"""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _JsonErrorServer(plain.request_handler, request_factory=plain.request_factory,
                                handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                                **plain._kwargs)
