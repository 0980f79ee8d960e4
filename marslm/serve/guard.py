"""What stands between the routes (app.py) and the clients: who may ask (the API key), what a
body may be (its size, and the time it may take to arrive), and how every failure is answered (one
handler per error type, and the outermost ASGI layer for what escapes the app).

Every refusal is an OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status (503 at shutdown, 500 for a bug). No error closes a keep-alive connection except those
that must (413 and 408: the rest of the body is never read); a client that hangs up is one line
in the log.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decode.params import ParamError
from .config import ServeConfig
from .openai import CHAT, APIError
from .requests import EngineError, EngineStopped, QueueFull
from .wire import error_body, send_json

log = logging.getLogger("marslm.server")


class ClientGone(Exception):
    """The client hung up; the message says when."""


def authorizer(api_key: str | None):
    """The dependency that checks ``Authorization: Bearer KEY`` (none without an API key)."""

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                type="authentication_error",
                code="invalid_api_key",
            )

    return authorize


async def read_body(request: Request, limits: ServeConfig) -> bytes:
    """The body, read as it arrives against the size limit and the body deadline."""
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise APIError(400, f"invalid Content-Length {declared[:40]!r}", headers={"Connection": "close"})
    if declared is not None and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    deadline = time.monotonic() + limits.body_timeout
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            log.info("%s sent no complete body within %g s: 408", client_name(request), limits.body_timeout)
            raise APIError(
                408,
                f"the request body did not arrive within {limits.body_timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        if message["type"] == "http.disconnect":
            raise ClientGone("while sending its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    # Connection: close: the rest of the body is never read, so the connection cannot carry on.
    return APIError(
        413,
        f"the request body is larger than {limit} bytes (--max-request-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def add_error_handlers(app: FastAPI) -> None:
    """Each error type answered once, as an OpenAI error object with its status."""

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(ParamError)
    async def _refused(request, exc: ParamError):
        # The engine calls a prompt it refuses "prompt"; a chat request sent it as "messages".
        param = exc.param
        if param == "prompt" and request.url.path == CHAT.path:
            param = CHAT.prompt_param
        return _error(400, str(exc), param=param, code=exc.code)

    @app.exception_handler(QueueFull)
    async def _queue_full(_request, exc: QueueFull):
        headers = {"Retry-After": str(exc.retry_after)}
        return _error(429, str(exc), "rate_limit_error", code="queue_full", headers=headers)

    @app.exception_handler(EngineStopped)
    async def _stopped(_request, exc: EngineStopped):
        return _error(503, str(exc), "server_error", code="shutting_down")

    @app.exception_handler(EngineError)
    async def _failed(_request, exc: EngineError):
        return _error(500, str(exc), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc):
        return _error(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc):  # starlette re-raises it afterwards: Guard logs it
        return _error(500, "internal server error", "server_error")

    @app.exception_handler(ClientGone)
    async def _client_gone(request, exc):  # nobody reads this answer
        log.info("%s went away %s", client_name(request), exc)
        return Response(status_code=499)


def _error(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def client_name(request) -> str:
    host, port = request.client or ("?", 0)
    return f"client {host}:{port}"


# ----------------------------------------------------------------------------------------- ASGI
class Guard:
    """The outermost ASGI layer. An exception that escapes the app is answered (a 500 OpenAI error
    object, or 503 when shutdown cancels the request) and logged once, then swallowed: uvicorn
    would close the keep-alive connection and log its own traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            log.warning("%s %s cancelled by the shutdown", scope.get("method"), scope.get("path"))
            if not started:
                await send_json(
                    send, 503, error_body("the server is shutting down", "server_error", code="shutting_down")
                )
        except Exception:  # noqa: BLE001 - a bug: log it with its traceback, keep serving
            log.exception("error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_json(send, 500, error_body("internal server error", "server_error"))
