"""An OpenAI-compatible HTTP front end over :class:`marslm.serve.engine.Engine` (FastAPI + uvicorn).

    POST /v1/chat/completions   POST /v1/completions      (``stream: true``: server-sent events)
    GET  /v1/models             GET  /health               GET /metrics (Prometheus text format)
    POST /admin/tau             GET|POST /admin/policy     (live default tau and tau policy)

OpenAI's ``temperature``, ``top_p``, ``seed`` and ``stop`` (up to 4 strings) are honoured. Beyond
them a request may carry (``extra_body`` in the openai client) ``tau``, ``metric``, ``block_size``,
``mode`` and ``top_k``; ``usage`` adds ``forwards`` and ``tokens_per_forward``. Completions take
raw text (as OpenAI's do); ``chat_template: true`` wraps the prompt as one user message instead.
Completions honour ``echo`` (the prompt before the completion's text, as vLLM does). Knobs the
engine does not have (penalties, ...) are ignored; ones that would change the answer's shape
(``n`` > 1, ``logprobs``, ``suffix``) are refused.

This module only translates: it parses and checks JSON, turns text into token ids (chat
formatting goes through ``marslm.chat.encode_prompt``), hands the ids to the engine and turns
the engine's tokens back into OpenAI objects. Every refusal is an OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (503 at shutdown).

What a client may take is bounded (:class:`ServerLimits`): the body's size (checked as it
arrives: 413 and the connection closed, the rest never read), the time to send a request's
head and its body, the number of open connections. JSON parsing and tokenization run on worker
threads, never on the event loop, so a big request delays no other request's stream, and a
prompt that cannot fit the model's context is refused before it is tokenized. No error closes
a keep-alive connection except those that must (413, 408); a client that hangs up is one line
in the log.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import encode_prompt
from ..decode import TextStream
from ..errors import UserError
from .config import ServeConfig
from .engine import Engine, EngineError, EngineStopped, InvalidRequest, QueueFull, Result, SamplingParams
from .metrics import render_metrics

log = logging.getLogger("marslm.server")

ROLES = ("system", "developer", "user", "assistant", "tool")
PARSE_WORKERS = 4  # threads that parse and tokenize requests


class APIError(Exception):
    """Answered as an OpenAI error object; the server carries on."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------------- request fields
_MISSING = object()


def _field(body: dict, name: str, kind: str, default=None, *, required: bool = False):
    """``body[name]`` checked against ``kind`` (int, number, str, bool, list, dict); None counts as absent."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise APIError(400, f"missing required parameter '{name}'", param=name, code="missing_required_parameter")
        return default
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "list": isinstance(value, list),
        "dict": isinstance(value, dict),
    }[kind]
    if not ok:
        kind_name = {
            "int": "an integer",
            "number": "a number",
            "str": "a string",
            "bool": "a boolean",
            "list": "an array",
            "dict": "an object",
        }[kind]
        raise APIError(400, f"'{name}' must be {kind_name}, got {_describe(value)}", param=name, code="invalid_type")
    return float(value) if kind == "number" else value


def _describe(value) -> str:
    """A value for an error message: short, and safe for any nesting depth."""
    if isinstance(value, (list, dict)):
        return f"an {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    return json.dumps(value)[:80]


def parse_sampling(body: dict, chat: bool) -> tuple[SamplingParams, bool, bool]:
    """``(params, stream, include_usage)`` from a request body; range checks are the engine's."""
    max_tokens = _field(body, "max_completion_tokens", "int") if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", "int")
    if _field(body, "n", "int", 1) != 1:
        raise APIError(400, "only n=1 is supported: send one request per choice", param="n")
    if _field(body, "best_of", "int", 1) != 1:
        raise APIError(400, "best_of is not supported", param="best_of")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise APIError(400, "'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    if body.get("logprobs") not in (None, False, 0):
        raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
    stream = _field(body, "stream", "bool", False)
    options = _field(body, "stream_options", "dict", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    params = SamplingParams(
        max_tokens=max_tokens,
        tau=_field(body, "tau", "number"),
        metric=_field(body, "metric", "str", "prob"),
        block_size=_field(body, "block_size", "int"),
        mode=_field(body, "mode", "str", "threshold"),
        temperature=_field(body, "temperature", "number", 0.0),
        top_p=_field(body, "top_p", "number", 1.0),
        top_k=_field(body, "top_k", "int", 0),
        seed=_field(body, "seed", "int"),
        stop=tuple(s for s in stop if s),
    )
    return params, stream, include_usage


def _content_text(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(
        400, f"{where}.content must be a string or a list of text parts", param="messages", code="invalid_type"
    )


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object. NaN and Infinity are not JSON (Python accepts them)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not valid JSON (numbers must be finite)")

    try:
        body = json.loads(raw, parse_constant=refuse)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _check_length(chars: int, max_chars: int | None, context: int | None, param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit the context (``max_chars``: see create_app)."""
    if max_chars is not None and chars > max_chars:
        raise APIError(
            400,
            f"the prompt has {chars} characters, too many for the model's context of {context} tokens",
            param=param,
            code="context_length_exceeded",
        )


def chat_prompt_ids(tokenizer, body: dict, max_chars: int | None = None, context: int | None = None) -> list[int]:
    messages = _field(body, "messages", "list", required=True)
    if not messages:
        raise APIError(400, "'messages' is empty", param="messages", code="empty_prompt")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object", param="messages", code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(
                400, f"{where}.role must be one of {', '.join(ROLES)}, got {_describe(role)}", param="messages"
            )
        clean.append({"role": role, "content": _content_text(message.get("content"), where)})
    if not any(m["content"] for m in clean):
        raise APIError(
            400, "the prompt is empty: every message has empty content", param="messages", code="empty_prompt"
        )
    _check_length(sum(len(m["content"]) for m in clean), max_chars, context, "messages")
    return _encode(tokenizer, clean, True, "messages")


def completion_prompt_ids(tokenizer, body: dict, max_chars: int | None = None, context: int | None = None) -> list[int]:
    prompt = _completion_prompt(tokenizer, body)
    if isinstance(prompt, str):
        _check_length(len(prompt), max_chars, context, "prompt")
    chat_template = _field(body, "chat_template", "bool", False)
    return _encode(tokenizer, prompt, chat_template, "prompt")


def completion_echo(tokenizer, body: dict) -> str:
    """The text ``echo: true`` puts before a completion: the prompt as sent (token ids decoded)."""
    prompt = _completion_prompt(tokenizer, body)
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def _completion_prompt(tokenizer, body: dict) -> str | list[int]:
    """The one prompt of a completions request: a string or token ids."""
    if body.get("suffix") is not None:  # insertion (text to complete up to) is not offered, as in vLLM
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "missing required parameter 'prompt'", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (send several requests; they are batched)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        vocab = len(tokenizer)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise APIError(
                400, f"a token-id prompt must hold integers in 0..{vocab - 1}", param="prompt", code="invalid_type"
            )
    elif not isinstance(prompt, str):
        raise APIError(400, "'prompt' must be a string or a list of token ids", param="prompt", code="invalid_type")
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    return prompt


def _encode(tokenizer, prompt, apply_chat_template: bool, param: str) -> list[int]:
    try:
        return encode_prompt(tokenizer, prompt, apply_chat_template)
    except UserError as exc:
        raise APIError(400, str(exc), param=param) from None
    except Exception as exc:  # a chat template that rejects these messages (jinja raise_exception)
        raise APIError(400, f"cannot format the prompt: {exc}", param=param) from None


# ---------------------------------------------------------------------------- response objects
def _usage(result: Result) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "forwards": result.forwards,
        "tokens_per_forward": round(result.tokens_per_forward, 4),
    }


def _cut_off(result: Result) -> APIError:
    """A request the engine cancelled while a client still waits: the server is shutting down."""
    return APIError(
        503,
        f"the server is shutting down; the answer was cut off after {result.completion_tokens} tokens",
        type="server_error",
        code="shutting_down",
    )


def max_token_chars(tokenizer) -> int:
    """The most text characters one token can stand for: a byte-level token's string has one
    character per byte, a SentencePiece piece one per character (a byte-fallback piece more)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


# ------------------------------------------------------------------------------------ the app
@dataclass(frozen=True)
class _Endpoint:
    """What differs between /v1/chat/completions and /v1/completions: names and the choice's shape."""

    chat: bool
    id_prefix: str
    object: str
    chunk_object: str
    prompt_param: str
    prompt_ids: Callable

    def choice(self, text: str, finish_reason: str) -> dict:
        if self.chat:
            return {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str | None, finish_reason: str | None, role: str | None = None) -> dict:
        if self.chat:
            delta = ({"role": role} if role else {}) | ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}


# The parsers are looked up at call time, so that a wrapper installed on the module takes effect.
CHAT = _Endpoint(
    True, "chatcmpl-", "chat.completion", "chat.completion.chunk", "messages", lambda *args: chat_prompt_ids(*args)
)
COMPLETION = _Endpoint(
    False, "cmpl-", "text_completion", "text_completion", "prompt", lambda *args: completion_prompt_ids(*args)
)


def create_app(engine: Engine, config: ServeConfig | None = None):
    """The ASGI app: FastAPI inside :class:`_Guard`. Its lifespan starts the engine (if not yet
    running) and stops it."""
    config = limits = config or engine.config
    api_key = config.api_key
    model_name = config.served_model_name or engine.model_name
    tokenizer = engine.tokenizer
    created = int(time.time())
    # Twice the most characters a token can cover (a normalizer may merge two characters into
    # one): a prompt longer than this cannot fit the context, whatever its tokens.
    max_chars = None if engine.max_context is None else 2 * max_token_chars(tokenizer) * engine.max_context
    # Parsing and tokenizing run on a few worker threads, never on the event loop: a big body
    # delays neither the streams nor the other requests' parsing. (The fast tokenizers encode
    # concurrently; nothing here changes their truncation or padding settings.)
    worker = ThreadPoolExecutor(max_workers=PARSE_WORKERS, thread_name_prefix="marslm-parse")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        # serve() drains the engine as shutdown begins; here only what is left (a plain uvicorn
        # run). Joining the engine thread blocks, so it runs off the loop.
        await asyncio.to_thread(engine.stop, config.shutdown_timeout)
        worker.shutdown(wait=False)

    app = FastAPI(title="marslm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return JSONResponse(
            error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc):
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc):  # starlette re-raises it afterwards: _Guard logs it
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    @app.exception_handler(ClientGone)
    async def _client_gone(request, exc):  # nobody reads this answer
        log.info("%s went away %s", _client(request), exc)
        return Response(status_code=499)

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

    auth = [Depends(authorize)]

    async def read_body(request: Request) -> bytes:
        """The body, read as it arrives against the size limit and the body deadline."""
        limit = limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            if not declared.isdigit():
                raise APIError(400, f"invalid Content-Length {declared[:40]!r}", headers={"Connection": "close"})
            raise _too_large(limit)
        chunks, size = [], 0
        deadline = time.monotonic() + limits.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(request.receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.info("%s sent no complete body within %g s: 408", _client(request), limits.body_timeout)
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

    async def json_body(request: Request) -> dict:
        return await off_loop(parse_json, await read_body(request))

    def check_model(body: dict) -> None:
        name = _field(body, "model", "str")
        if name is not None and name not in (model_name, engine.model_name):
            raise APIError(
                404,
                f"the model {_describe(name)} does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )

    def submit(prompt_ids: list[int], params: SamplingParams, prompt_param: str):
        try:
            return engine.submit(prompt_ids, params)
        except InvalidRequest as exc:
            param = prompt_param if exc.param in ("prompt", "messages") else exc.param
            raise APIError(400, str(exc), param=param, code=exc.code) from None
        except QueueFull as exc:
            raise APIError(
                429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(exc.retry_after)}
            ) from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="shutting_down") from None

    async def collect(request: Request, stream) -> tuple[Result, str]:
        """Wait for the whole answer; a client that hangs up meanwhile cancels its request."""

        async def tokens():
            async for _ in stream:
                pass
            return stream.result

        task = asyncio.ensure_future(tokens())
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                raise ClientGone("before its answer was ready; its row is freed")
            result = task.result()
        except EngineError as exc:
            raise APIError(500, str(exc), type="server_error") from None
        finally:
            watch.cancel()
            if not task.done():  # the client hung up, or shutdown cancelled us: free the row
                engine.cancel(stream.request_id)
                task.cancel()
        if result.finish_reason == "cancelled":
            raise _cut_off(result)
        text = result.text if result.text is not None else tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return result, text

    async def events(stream, make_chunk, include_usage: bool, stop: tuple, first_chunk=None):
        """Server-sent events: one chunk per step that produced text, then finish, usage, [DONE].
        The text goes through the same stop strings as the engine's, so no chunk shows text past one."""
        detok = TextStream(tokenizer, stop)
        try:
            if first_chunk is not None:
                yield _sse(first_chunk)
            async for ids in stream:
                delta = detok.push(ids)
                if delta:
                    yield _sse(make_chunk(delta, None))
            result = stream.result
            if result.finish_reason == "cancelled":  # the stream's last event says why it ends early
                error = _cut_off(result)
                yield _sse(error_body(error.message, error.type, code=error.code))
            else:
                yield _sse(make_chunk(detok.finish(), result.finish_reason))
                if include_usage:
                    yield _sse(make_chunk(None, None, usage=_usage(result)))
        except EngineError as exc:
            yield _sse(error_body(str(exc), "server_error"))
        finally:
            # Normal end: a no-op. A client that hung up (starlette cancels this generator) or a
            # shutdown that ran out of patience: the row is freed before the next step.
            if stream.result is None:
                engine.cancel(stream.request_id)
        yield "data: [DONE]\n\n"

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine.snapshot(), model_name), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "marslm",
                    "max_model_len": engine.max_context,
                    "block_size": engine.trained_block_size,
                }
            ],
        }

    async def complete(request: Request, api: _Endpoint):
        """Both completion endpoints: parse, submit, then stream chunks or answer once."""
        body = await json_body(request)
        check_model(body)
        params, stream_mode, include_usage = parse_sampling(body, chat=api.chat)
        echo = not api.chat and _field(body, "echo", "bool", False)
        prompt_ids = await off_loop(api.prompt_ids, tokenizer, body, max_chars, engine.max_context)
        echoed = await off_loop(completion_echo, tokenizer, body) if echo else ""
        stream = submit(prompt_ids, params, api.prompt_param)
        rid, now = api.id_prefix + secrets.token_hex(12), int(time.time())

        def chunk(text, finish_reason, usage=None, role=None):
            out = {
                "id": rid,
                "object": api.chunk_object,
                "created": now,
                "model": model_name,
                "choices": [] if usage is not None else [api.chunk_choice(text, finish_reason, role)],
            }
            if usage is not None:
                out["usage"] = usage
            return out

        if stream_mode:
            # OpenAI's first chat chunk names the role; an echoed prompt comes before the completion
            opening = chunk("", None, role="assistant") if api.chat else chunk(echoed, None) if echoed else None
            return StreamingResponse(
                events(stream, chunk, include_usage, params.stop, opening), media_type="text/event-stream"
            )
        result, text = await collect(request, stream)
        return {
            "id": rid,
            "object": api.object,
            "created": now,
            "model": model_name,
            "choices": [api.choice(echoed + text, result.finish_reason)],
            "usage": _usage(result),
        }

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        return await complete(request, CHAT)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        return await complete(request, COMPLETION)

    # --- admin: the default tau and its policy, live (from the next step on, no restart)
    @app.post("/admin/tau", dependencies=auth)
    async def admin_tau(request: Request):
        body = await json_body(request)
        tau = _field(body, "tau", "number", required=True)
        try:
            return engine.set_default_tau(tau)
        except UserError as exc:
            raise APIError(400, str(exc), param="tau") from None

    @app.get("/admin/policy", dependencies=auth)
    async def admin_policy_get():
        return engine.controller.state()

    @app.post("/admin/policy", dependencies=auth)
    async def admin_policy(request: Request):
        body = await json_body(request)
        slo = _field(body, "slo_ms", "number") if "slo_ms" in body else "keep"  # null switches the SLO off
        try:
            return engine.set_policy(
                _field(body, "policy", "str"),
                tau=_field(body, "tau", "number"),
                floor=_field(body, "tau_floor", "number"),
                slo_ms=slo,
            )
        except UserError as exc:
            raise APIError(400, str(exc)) from None

    return _Guard(app)


class ClientGone(Exception):
    """The client hung up; the message says when."""


def _too_large(limit: int) -> APIError:
    # Connection: close: the rest of the body is never read, so the connection cannot carry on.
    return APIError(
        413,
        f"the request body is larger than {limit} bytes (--max-request-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def _client(request) -> str:
    host, port = request.client or ("?", 0)
    return f"client {host}:{port}"


class _Guard:
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
                await _send_json(
                    send, 503, error_body("the server is shutting down", "server_error", code="shutting_down")
                )
        except Exception:  # noqa: BLE001 - a bug: log it with its traceback, keep serving
            log.exception("error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await _send_json(send, 500, error_body("internal server error", "server_error"))


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _disconnected(request) -> None:
    """Returns when the client hangs up (uvicorn answers ``receive`` with http.disconnect then;
    it also does so once the response is complete, by which time nobody waits on this)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# --------------------------------------------------------------------------------------- serve
def serve(model: str, config: ServeConfig | None = None) -> None:
    """Load ``model``, bind ``host:port`` (0: any free port) and serve until SIGINT/SIGTERM.

    SIGTERM: stop accepting connections, let in-flight requests finish for up to
    ``shutdown_timeout`` seconds, cancel the rest (each gets a 503 error object, or a last stream
    event saying so), stop the engine, return (exit status 0).
    """
    import uvicorn

    config = config or ServeConfig()
    shutdown_timeout = config.shutdown_timeout
    logging.getLogger("marslm").setLevel(config.log_level.upper())  # disconnects and timeouts are info lines
    sock = _bind(config.host, config.port)  # before the slow model load: a taken port fails at once
    try:
        engine = Engine.from_pretrained(model, config)
    except BaseException:
        sock.close()
        raise
    sock.listen(2048)
    app = create_app(engine, config)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # Drain the engine while uvicorn waits for the connections: requests still running
            # at the deadline are cancelled there, and their handlers answer 503 themselves.
            drain = asyncio.ensure_future(asyncio.to_thread(engine.stop, shutdown_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                await drain

    # uvicorn's own deadline (it then cancels handlers outright) is only a safety net behind the engine's.
    server = Server(
        uvicorn.Config(
            app,
            log_level=config.log_level,
            access_log=False,
            lifespan="on",
            http=_protocol(config),
            timeout_keep_alive=config.keep_alive_timeout,
            timeout_graceful_shutdown=math.ceil(shutdown_timeout) + 10,
        )
    )
    bound_host, bound_port = sock.getsockname()[:2]
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", config.host)
    print(
        f"marslm serve: {engine.model_name} listening on http://{_url_host(bound_host)}:{bound_port} "
        f"(max batch {engine.max_batch}, tau {engine.controller.tau}, policy {engine.controller.policy})",
        flush=True,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with the
    # default SIGTERM action that would kill the process (status -15) after a clean shutdown.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: shut down"))
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(0)
        sock.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _protocol(limits: ServeConfig):
    """uvicorn's h11 protocol with two guards for slow or many clients: a deadline for every
    request's line and headers (uvicorn has none: a client sending half a request held its socket
    for good), and a cap on open connections."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    too_many = json.dumps(
        error_body("too many open connections; retry later", "server_error", code="too_many_connections")
    ).encode()

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            self._head_timer = None
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning("refusing a connection: %d are open already (--max-connections)", limits.max_connections)
                transport.write(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(too_many), too_many)
                )
                transport.close()
                return
            self._await_head()

        def on_response_complete(self):
            super().on_response_complete()
            self._await_head()

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _await_head(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_overdue)

        def _head_overdue(self):
            self._head_timer = None
            # IDLE: no complete request line and headers since the connection (or the last
            # response) began. A request being read or answered is the body deadline's business.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                host, port = self.client or ("?", 0)
                log.info(
                    "client %s:%s sent no complete request head within %g s: closing", host, port, limits.header_timeout
                )
                self.transport.close()

    return Protocol


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
