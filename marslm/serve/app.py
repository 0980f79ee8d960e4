"""An OpenAI-compatible HTTP front end over :class:`marslm.serve.engine.Engine` (FastAPI + uvicorn).

    POST /v1/chat/completions   POST /v1/completions      (``stream: true``: server-sent events)
    GET  /v1/models[/{id}]      GET  /health               GET /metrics (Prometheus text format)
    POST /admin/tau             GET|POST /admin/policy     (live default tau and tau policy)

OpenAI's ``temperature``, ``top_p``, ``seed`` and ``stop`` (up to 4 strings) are honoured. Beyond
them a request may carry (``extra_body`` in the openai client) ``tau``, ``metric``, ``block_size``,
``mode`` and ``top_k``; ``usage`` adds ``forwards`` and ``tokens_per_forward``. Completions take
raw text (as OpenAI's do); ``chat_template: true`` wraps the prompt as one user message instead.
Completions honour ``echo`` (the prompt before the completion's text, as vLLM does). Knobs the
engine does not have (penalties, ...) are ignored; ones that would change the answer's shape
(``n`` > 1, ``logprobs``, ``suffix``) are refused.

The routes only translate: they read the body, let openai.py parse and check it and turn text
into token ids, hand the ids to the engine and turn the engine's tokens back into OpenAI objects
(openai.py again), whole or as server-sent events. What a client may send, and how each refusal
is answered, is guard.py's. A server with a separate drafter (``--draft-model``) names it in each
model card (``drafter``) and in /metrics (``marslm_drafter_info``).

What a client may take is bounded (``ServeConfig``): the body's size and the time it takes to
arrive (guard.py), the time to send a request's head, the number of open connections (http.py).
JSON parsing and tokenization run on worker threads, never on the event loop, so a big request
delays no other request's stream, and a prompt that cannot fit the model's context is refused
before it is tokenized.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..decode import TextStream
from ..decode.params import describe, read_field
from ..errors import UserError
from .config import served_names
from .engine import Engine
from .guard import ClientGone, Guard, add_error_handlers, authorizer, read_body
from .metrics import render_metrics
from .openai import (
    CHAT,
    COMPLETION,
    APIError,
    Endpoint,
    completion_echo,
    cut_off,
    max_token_chars,
    parse_json,
    parse_options,
    usage,
)
from .requests import EngineError, Result
from .wire import error_body

PARSE_WORKERS = 4  # threads that parse and tokenize requests


def create_app(engine: Engine, model: str):
    """The ASGI app serving ``engine``, which runs ``model`` (a path or hub id: the names it answers
    to are :func:`~marslm.serve.config.served_names`): FastAPI inside :class:`~marslm.serve.guard.Guard`. Its
    lifespan starts the engine (if not yet running) and stops it."""
    service = _Service(engine, model)
    app = FastAPI(title="marslm", lifespan=service.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    _add_routes(app, service, [Depends(authorizer(service.config.api_key))])
    return Guard(app)


def _add_routes(app: FastAPI, service: _Service, auth: list) -> None:
    engine = service.engine

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = render_metrics(engine.snapshot(), service.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return service.models()

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def model(name: str):
        return service.model_card(name)

    @app.post(CHAT.path, dependencies=auth)
    async def chat_completions(request: Request):
        return await service.complete(request, CHAT)

    @app.post(COMPLETION.path, dependencies=auth)
    async def completions(request: Request):
        return await service.complete(request, COMPLETION)

    # --- admin: the default tau and its policy, live (from the next step on, no restart). The
    # controller's refusals are about its state (a floor above the default, say) rather than one
    # field of the body, so these routes answer them with a 400 of their own.
    @app.post("/admin/tau", dependencies=auth)
    async def admin_tau(request: Request):
        body = await service.json_body(request)
        tau = read_field(body, "tau", "number", required=True)
        try:
            return engine.set_policy(tau=tau)
        except UserError as exc:
            raise APIError(400, str(exc), param="tau") from None

    @app.get("/admin/policy", dependencies=auth)
    async def admin_policy_get():
        return engine.controller.state()

    @app.post("/admin/policy", dependencies=auth)
    async def admin_policy(request: Request):
        body = await service.json_body(request)
        slo = read_field(body, "slo_ms", "number") if "slo_ms" in body else "keep"  # null switches the SLO off
        policy, tau = read_field(body, "policy", "str"), read_field(body, "tau", "number")
        floor = read_field(body, "tau_floor", "number")
        try:
            return engine.set_policy(policy, tau=tau, floor=floor, slo_ms=slo)
        except UserError as exc:
            raise APIError(400, str(exc)) from None


class _Service:
    """What the routes share: the engine, the served names, the limits and the parse workers."""

    def __init__(self, engine: Engine, model: str):
        self.engine, self.config, self.tokenizer = engine, engine.config, engine.tokenizer
        self.model = model
        self.names = served_names(model, self.config.served_model_name)
        self.model_name = self.names[0]  # the name answers carry
        self.created = int(time.time())
        # Twice the most characters a token can cover (a normalizer may merge two characters into
        # one): a prompt longer than this cannot fit the context, whatever its tokens.
        context = engine.limits.context
        self.max_chars = None if context is None else 2 * max_token_chars(self.tokenizer) * context
        # Parsing and tokenizing run on a few worker threads, never on the event loop: a big body
        # delays neither the streams nor the other requests' parsing. (The fast tokenizers encode
        # concurrently; nothing here changes their truncation or padding settings.)
        self.worker = ThreadPoolExecutor(max_workers=PARSE_WORKERS, thread_name_prefix="marslm-parse")

    @asynccontextmanager
    async def lifespan(self, _app):
        self.engine.start()
        yield
        # serve() drains the engine as shutdown begins; here only what is left (a plain uvicorn
        # run). Joining the engine thread blocks, so it runs off the loop.
        await asyncio.to_thread(self.engine.stop, self.config.shutdown_timeout)
        self.worker.shutdown(wait=False)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def json_body(self, request: Request) -> dict:
        return await self.off_loop(parse_json, await read_body(request, self.config))

    def models(self) -> dict:
        """One card per served name, as vLLM lists them."""
        return {"object": "list", "data": [self._card(name) for name in self.names]}

    def model_card(self, name: str) -> dict:
        """The card of one served name (``models.retrieve`` in the openai client); 404 for others."""
        self.check_model({"model": name})
        return self._card(name)

    def _card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "marslm",
            "root": self.model,
            "max_model_len": self.engine.limits.context,
            "block_size": self.engine.limits.trained_block_size,
            **({"drafter": self.engine.drafter_card} if self.engine.drafter_card else {}),
        }

    def check_model(self, body: dict) -> None:
        name = read_field(body, "model", "str")
        if name is not None and name not in self.names:
            served = ", ".join(f"'{n}'" for n in self.names)
            raise APIError(
                404,
                f"the model {describe(name)} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    async def complete(self, request: Request, api: Endpoint):
        """Both completion endpoints: parse, submit, then stream chunks or answer once."""
        body = await self.json_body(request)
        self.check_model(body)
        params, stream_mode, include_usage = parse_options(body, chat=api.chat)
        echo = not api.chat and read_field(body, "echo", "bool", False)
        context = self.engine.limits.context
        prompt_ids = await self.off_loop(api.prompt_ids, self.tokenizer, body, self.max_chars, context)
        echoed = await self.off_loop(completion_echo, self.tokenizer, body) if echo else ""
        stream = self.engine.submit(prompt_ids, params)
        rid, now = api.id_prefix + secrets.token_hex(12), int(time.time())
        chunk = partial(api.chunk, rid, now, self.model_name)
        if stream_mode:
            # OpenAI's first chat chunk names the role; an echoed prompt comes before the completion
            opening = chunk("", None, role="assistant") if api.chat else chunk(echoed, None) if echoed else None
            return StreamingResponse(
                self.events(stream, chunk, include_usage, params.stop, opening), media_type="text/event-stream"
            )
        result, text = await self.collect(request, stream)
        return api.response(rid, now, self.model_name, echoed + text, result)

    async def collect(self, request: Request, stream) -> tuple[Result, str]:
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
        finally:
            watch.cancel()
            if not task.done():  # the client hung up, or shutdown cancelled us: free the row
                self.engine.cancel(stream.request_id)
                task.cancel()
        if result.finish_reason == "cancelled":
            raise cut_off(result)
        if result.text is not None:
            return result, result.text
        return result, self.tokenizer.decode(result.token_ids, skip_special_tokens=True)

    async def events(self, stream, make_chunk, include_usage: bool, stop: tuple, first_chunk=None):
        """Server-sent events: one chunk per step that produced text, then finish, usage, [DONE].
        The text goes through the same stop strings as the engine's, so no chunk shows text past one."""
        detok = TextStream(self.tokenizer, stop)
        try:
            if first_chunk is not None:
                yield _sse(first_chunk)
            async for ids in stream:
                delta = detok.push(ids)
                if delta:
                    yield _sse(make_chunk(delta, None))
            result = stream.result
            if result.finish_reason == "cancelled":  # the stream's last event says why it ends early
                error = cut_off(result)
                yield _sse(error_body(error.message, error.type, code=error.code))
            else:
                yield _sse(make_chunk(detok.finish(), result.finish_reason))
                if include_usage:
                    yield _sse(make_chunk(None, None, usage=usage(result)))
        except EngineError as exc:
            yield _sse(error_body(str(exc), "server_error"))
        finally:
            # Normal end: a no-op. A client that hung up (starlette cancels this generator) or a
            # shutdown that ran out of patience: the row is freed before the next step.
            if stream.result is None:
                self.engine.cancel(stream.request_id)
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _disconnected(request) -> None:
    """Returns when the client hangs up (uvicorn answers ``receive`` with http.disconnect then;
    it also does so once the response is complete, by which time nobody waits on this)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
