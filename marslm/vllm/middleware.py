"""HTTP middleware for vLLM's OpenAI server (``--middleware marslm.vllm.middleware.MarsMiddleware``).

Requests: ``tau``, ``metric`` and ``mode`` may stand at the top of the body, as ``marslm serve``
takes them (the openai client's ``extra_body``); they move into ``vllm_xargs``, which vLLM hands
to the engine as ``SamplingParams.extra_args``. Values a server must refuse get a 400 with an
OpenAI error object here, before vLLM's pydantic model would coerce them (``true`` into 1).

Responses: ``usage`` gains ``forwards`` and ``tokens_per_forward``, as ``marslm serve`` reports
them, from vLLM's per-request acceptance metrics (the scheduler counts every forward into them).
Tokens per forward counts every decoded token, the stop token included. In a stream, the usage
chunk (``stream_options.include_usage``) carries them.
"""

from __future__ import annotations

import json

from ..decode.params import ParamError
from ..serve.wire import error_body, send_json
from .request_settings import FIELDS, check_request, is_greedy

PATHS = ("/v1/chat/completions", "/v1/completions")


class MarsMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        try:
            body = rewrite_request(body)
        except ParamError as exc:
            await send_json(send, 400, error_body(str(exc), "invalid_request_error", exc.param, exc.code))
            return
        scope = dict(scope, headers=_with_length(scope["headers"], len(body)))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnects

        await self.app(scope, replay, _UsageWriter(send))


def rewrite_request(raw: bytes) -> bytes:
    """Move the MARS fields into ``vllm_xargs``; a body that is not a JSON object passes as it is
    (vLLM answers it)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(body, dict):
        return raw
    if body.get("block_size") is not None:
        raise ParamError(
            "'block_size' is not supported by the vLLM engine: each step reads the checkpoint's block size of masks",
            "block_size",
        )
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return raw
    moved = {name: body.pop(name) for name in FIELDS if body.get(name) is not None}
    xargs = {**xargs, **moved}
    check_request(xargs, greedy=is_greedy(body.get("temperature")))
    if not moved:
        return raw
    body["vllm_xargs"] = xargs
    return json.dumps(body).encode()


def add_forwards(payload: dict) -> dict:
    """``usage.forwards`` and ``usage.tokens_per_forward`` from ``metrics.speculative_decoding``."""
    if not isinstance(payload, dict):
        return payload
    usage = payload.get("usage")
    spec = (payload.get("metrics") or {}).get("speculative_decoding")
    if isinstance(usage, dict) and isinstance(spec, dict) and spec.get("num_spec_steps"):
        forwards = spec["num_spec_steps"]
        usage["forwards"] = forwards
        usage["tokens_per_forward"] = round(usage.get("completion_tokens", 0) / forwards, 4)
    return payload


class _UsageWriter:
    """Wraps ``send``: JSON bodies are rewritten whole, event streams event by event."""

    def __init__(self, send):
        self.send = send
        self.start = None
        self.kind = None
        self.buffer = b""

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            content_type = headers.get(b"content-type", b"")
            self.kind = (
                "json"
                if content_type.startswith(b"application/json")
                else "sse"
                if content_type.startswith(b"text/event-stream")
                else None
            )
            if self.kind == "json":
                self.start = message  # sent with the rewritten body, whose length changes
                return
            await self.send(message)
            return
        if message["type"] != "http.response.body" or self.kind is None:
            await self.send(message)
            return
        self.buffer += message.get("body", b"")
        more = message.get("more_body", False)
        if self.kind == "json":
            if more:
                return
            body = self.buffer
            try:
                body = json.dumps(add_forwards(json.loads(body))).encode()
            except ValueError:
                pass
            await self.send(dict(self.start, headers=_with_length(self.start.get("headers") or [], len(body))))
            await self.send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if more:  # pass on whole events only: the usage event must be read in one piece
            complete, separator, self.buffer = self.buffer.rpartition(b"\n\n")
            if not separator:
                return
            payload = complete + separator
        else:
            payload, self.buffer = self.buffer, b""
        await self.send(
            {
                "type": "http.response.body",
                "more_body": more,
                "body": b"\n\n".join(_rewrite_event(event) for event in payload.split(b"\n\n")),
            }
        )


def _rewrite_event(event: bytes) -> bytes:
    if event.startswith(b"data: {") and b'"usage"' in event:
        try:
            return b"data: " + json.dumps(add_forwards(json.loads(event[len(b"data: ") :]))).encode()
        except ValueError:
            pass
    return event


def _with_length(headers, length: int) -> list:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return kept + [(b"content-length", str(length).encode())]


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
