"""Admission from the headers alone and the error shape of every answer (step 0 of app.py's lifecycle).

``Guard`` is the app's middleware and ``Expect: 100-continue`` handler: the API key on ``/v1/*``
(401) and the declared body size (413) before a byte of the body is read; every error, aiohttp's
own 404/405/413 and an unexpected exception (500) included, leaves as OpenAI-style JSON
(Anthropic's shape on ``/v1/messages*``). Once a stream is prepared (``STREAMING``), errors are
events inside it and pass through.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from services.adapters.logging import get_logger
from services.drivers.gateway import anthropic_api
from services.drivers.gateway.api import ApiError
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
    if exc.status == 404:
        return ApiError(404, f"no such endpoint: {req.method} {req.path}", None, code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return ApiError(405, f"method {req.method} is not allowed on {req.path} (allowed: {allowed})", None,
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
            return self.error(ApiError(417, f"unknown Expect: {req.headers.get('Expect')}", None,
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
            return self.error(ApiError(400, f"the request body could not be read: {why}", "body",
                                        code="invalid_body"), None, req.path)
        except Exception as exc:
            if req.get(STREAMING):
                raise
            log.exception("internal_error", path=req.path, error=str(exc))
            return self.error(ApiError(500, f"internal error: {type(exc).__name__}", None,
                                        code="internal_error"), None, req.path)

    def error(self, exc: ApiError, headers: dict[str, str] | None = None, path: str = "") -> web.Response:
        self.metrics.inc("ei_gateway_errors_total", status=str(exc.status), code=exc.code)
        return error_response(exc, headers, path)
