"""The OpenAI API's objects: request fields read and checked, prompts turned into token ids,
responses and stream chunks built, and the error object every refusal is answered with.

A refused request field is a ``ParamError`` (``marslm.decode.params``), wherever it is found:
here, in the engine's checks or in ``DecodingParams.validate``; the app answers it with a 400 in
one place. :class:`APIError` is for the rest, which has a status of its own (a body that is not
JSON, a missing API key, an unknown model, a shutdown).

Nothing here touches HTTP or the engine's thread: each function takes a parsed body (or a
result) and returns plain values, so the routes (app.py) only move them between the two.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ..chat import encode_prompt
from ..decode.params import DecodingParams, ParamError, describe, read_field
from ..errors import UserError
from .requests import Result, request_params

ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An HTTP answer other than a refused field, as an OpenAI error object; the server carries on."""

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


# ------------------------------------------------------------------------------- request fields
# The request fields that are DecodingParams fields of the same name, and their JSON kinds; an
# absent one keeps DecodingParams' default (tau: the server's; max_tokens and stop are read apart).
DECODING_FIELDS = {
    "tau": "number",
    "metric": "str",
    "block_size": "int",
    "mode": "str",
    "temperature": "number",
    "top_p": "number",
    "top_k": "int",
    "seed": "int",
}


def parse_options(body: dict, chat: bool) -> tuple[DecodingParams, bool, bool]:
    """``(params, stream, include_usage)`` from a request body: the request's settings as
    :func:`~marslm.serve.requests.request_params` (None: the server's default); range checks are
    the engine's."""
    max_tokens = read_field(body, "max_completion_tokens", "int") if chat else None
    if max_tokens is None:
        max_tokens = read_field(body, "max_tokens", "int")
    if read_field(body, "n", "int", 1) != 1:
        raise ParamError("only n=1 is supported: send one request per choice", param="n")
    if read_field(body, "best_of", "int", 1) != 1:
        raise ParamError("best_of is not supported", param="best_of")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
        raise ParamError("'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    if body.get("logprobs") not in (None, False, 0):
        raise ParamError("logprobs are not supported", param="logprobs", code="unsupported_parameter")
    stream = read_field(body, "stream", "bool", False)
    include_usage = read_field(body, "stream_options", "dict", {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ParamError("'stream_options.include_usage' must be a boolean", param="stream_options")
    named = {name: read_field(body, name, kind) for name, kind in DECODING_FIELDS.items()}
    params = request_params(
        max_new_tokens=max_tokens,
        stop=tuple(s for s in stop if s),
        **{name: value for name, value in named.items() if value is not None},
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
    raise ParamError(f"{where}.content must be a string or a list of text parts", param="messages", code="invalid_type")


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
    """Refuse, before tokenizing, text that cannot fit the context (``max_chars``: see app.py's _Service)."""
    if max_chars is not None and chars > max_chars:
        raise ParamError(
            f"the prompt has {chars} characters, too many for the model's context of {context} tokens",
            param=param,
            code="context_length_exceeded",
        )


def chat_prompt_ids(tokenizer, body: dict, max_chars: int | None = None, context: int | None = None) -> list[int]:
    messages = read_field(body, "messages", "list", required=True)
    if not messages:
        raise ParamError("'messages' is empty", param="messages", code="empty_prompt")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ParamError(f"{where} must be an object", param="messages", code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise ParamError(f"{where}.role must be one of {', '.join(ROLES)}, got {describe(role)}", param="messages")
        clean.append({"role": role, "content": _content_text(message.get("content"), where)})
    if not any(m["content"] for m in clean):
        raise ParamError("the prompt is empty: every message has empty content", param="messages", code="empty_prompt")
    _check_length(sum(len(m["content"]) for m in clean), max_chars, context, "messages")
    return _encode(tokenizer, clean, True, "messages")


def completion_prompt_ids(tokenizer, body: dict, max_chars: int | None = None, context: int | None = None) -> list[int]:
    prompt = _completion_prompt(tokenizer, body)
    if isinstance(prompt, str):
        _check_length(len(prompt), max_chars, context, "prompt")
    chat_template = read_field(body, "chat_template", "bool", False)
    return _encode(tokenizer, prompt, chat_template, "prompt")


def completion_echo(tokenizer, body: dict) -> str:
    """The text ``echo: true`` puts before a completion: the prompt as sent (token ids decoded)."""
    prompt = _completion_prompt(tokenizer, body)
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def _completion_prompt(tokenizer, body: dict) -> str | list[int]:
    """The one prompt of a completions request: a string or token ids."""
    if body.get("suffix") is not None:  # insertion (text to complete up to) is not offered, as in vLLM
        raise ParamError("suffix is not supported", param="suffix", code="unsupported_parameter")
    prompt = body.get("prompt")
    if prompt is None:
        raise ParamError("missing required parameter 'prompt'", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ParamError("one prompt per request (send several requests; they are batched)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        vocab = len(tokenizer)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ParamError(
                f"a token-id prompt must hold integers in 0..{vocab - 1}", param="prompt", code="invalid_type"
            )
    elif not isinstance(prompt, str):
        raise ParamError("'prompt' must be a string or a list of token ids", param="prompt", code="invalid_type")
    if not prompt:
        raise ParamError("the prompt is empty", param="prompt", code="empty_prompt")
    return prompt


def _encode(tokenizer, prompt, apply_chat_template: bool, param: str) -> list[int]:
    try:
        return encode_prompt(tokenizer, prompt, apply_chat_template)
    except UserError as exc:
        raise ParamError(str(exc), param=param) from None
    except Exception as exc:  # a chat template that rejects these messages (jinja raise_exception)
        raise ParamError(f"cannot format the prompt: {exc}", param=param) from None


# ---------------------------------------------------------------------------- response objects
def usage(result: Result) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "forwards": result.forwards,
        "tokens_per_forward": round(result.tokens_per_forward, 4),
        # what it was decoded under: its tau (None in lossless mode) and the load policy over masks
        "tau": result.tau,
        "mask_batch_limit": result.mask_batch_limit,
        "cost_table": result.cost_table,
        "compiled": result.compiled,
    }


def cut_off(result: Result) -> APIError:
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


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/chat/completions and /v1/completions: names and the choice's shape."""

    path: str
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

    def response(self, rid: str, created: int, model: str, text: str, result: Result) -> dict:
        return {
            "id": rid,
            "object": self.object,
            "created": created,
            "model": model,
            "choices": [self.choice(text, result.finish_reason)],
            "usage": usage(result),
        }

    def chunk(
        self,
        rid: str,
        created: int,
        model: str,
        text: str | None,
        finish_reason: str | None,
        usage: dict | None = None,
        role: str | None = None,
    ) -> dict:
        """One server-sent event's object: a piece of text, the finish reason, or (last) the usage."""
        out = {
            "id": rid,
            "object": self.chunk_object,
            "created": created,
            "model": model,
            "choices": [] if usage is not None else [self.chunk_choice(text, finish_reason, role)],
        }
        if usage is not None:
            out["usage"] = usage
        return out


CHAT = Endpoint(
    "/v1/chat/completions", True, "chatcmpl-", "chat.completion", "chat.completion.chunk", "messages", chat_prompt_ids
)
COMPLETION = Endpoint(
    "/v1/completions", False, "cmpl-", "text_completion", "text_completion", "prompt", completion_prompt_ids
)
