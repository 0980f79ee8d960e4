"""What a request to the serving engine is: its settings (a ``DecodingParams``), the limits they are checked
against, the engine's record of it, the stream a handler reads (fed from the engine's thread) and
the result it ends with, and the ways it can be refused.
The engine (engine.py) runs requests; the API layer (openai.py, app.py) builds and answers them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..decode.params import DecodingParams, ParamError, check_default_tau, reads_tau

if TYPE_CHECKING:
    from ..decode import FinishedRow, TextStream


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``: the caller should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class EngineStopped(Exception):
    """The engine is shutting down (or has died) and takes no new requests."""


class EngineError(Exception):
    """Decoding failed for a request (the engine itself keeps serving)."""


def request_params(**fields) -> DecodingParams:
    """One request's settings as the server reads them: ``tau`` and ``max_new_tokens`` are None
    (the server's defaults) unless the request names them. The engine fills ``max_new_tokens`` in
    when it checks the request (:meth:`RequestLimits.resolve`), and gives a request that names no
    tau the server's default tau, live, while it decodes."""
    return DecodingParams(**{"tau": None, "max_new_tokens": None, **fields})


@dataclass
class Result:
    token_ids: list[int]  # new tokens, the stop token excluded
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    accepted_per_step: list[int]  # tokens accepted in each forward the request took part in
    tau: float | None  # the row's tau when it finished (None: lossless)
    text: str | None = None  # set when a stop string ended it: the text before the stop string
    # the server's load policy over masks (--mask-batch-limit): None (off, the text follows the
    # request alone), a batch size, or "auto"; with one on, the text at tau < 1 follows the load
    mask_batch_limit: int | str | None = None
    cost_table: str | None = None  # the cost table an auto limit read (costs.py), None for none
    compiled: bool = False  # the step ran compiled (compile_policy.py)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def forwards(self) -> int:
        return len(self.accepted_per_step)

    @property
    def tokens_per_forward(self) -> float:
        """Decoded tokens (the stop token included) per forward, as ``GenerationResult`` counts them."""
        return sum(self.accepted_per_step) / self.forwards if self.forwards else 0.0


class RequestStream:
    """What a request handler holds: ``async for ids in stream`` yields each step's new tokens;
    ``stream.result`` holds the :class:`Result` once iteration ends. A decoding failure raises
    :class:`EngineError` from the iteration."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.result: Result | None = None

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        while True:
            item = await self.queue.get()
            if isinstance(item, Result):
                self.result = item
                return
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass(eq=False)
class RequestState:
    """The engine's record of one request, waiting or running: its checked settings, the stream
    its handler reads, its timings and the tokens it has been sent so far."""

    id: str
    prompt_ids: list[int]
    settings: DecodingParams  # checked; tau None until it joins the batch when it follows the default
    follows_default: bool  # named no tau: the default tau reaches it, live
    text: TextStream | None  # watches for stop strings
    stream: RequestStream
    arrived: float
    admitted: float | None = None
    first_token: float | None = None
    tokens: list[int] = field(default_factory=list)  # tokens already published

    @property
    def tau(self) -> float | None:
        """The tau its result reports: its row's (None in lossless mode, which reads none)."""
        return self.settings.tau if reads_tau(self.settings.mode) else None

    def cancelled(self) -> Result:
        """What a cancelled request got so far (its steps' accept counts are dropped with its row)."""
        return Result(list(self.tokens), "cancelled", len(self.prompt_ids), [], self.tau)

    def finished(self, row: FinishedRow) -> Result:
        """What its row ended with; a stop string ends the text (and the tokens) just before it."""
        token_ids, reason, text = row.token_ids, "stop" if row.stopped else "length", None
        if self.text is not None:
            token_ids = self.text.close(row.token_ids)
            if self.text.stopped:
                reason, text = "stop", self.text.text
        return Result(token_ids, reason, len(self.prompt_ids), row.accepted_per_step, self.tau, text)


def send_to_loop(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Put each ``(queue, item)`` on its asyncio queue from the engine thread, in one wake-up of ``loop``."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
        pass


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of one model on one server: its context, and ``max_tokens``'s
    default and bound."""

    context: int | None  # the model's max_position_embeddings (None: unbounded)
    default_max_tokens: int
    max_tokens_limit: int
    trained_block_size: int | None

    def resolve(self, prompt_ids: list[int], params: DecodingParams, default_tau: float) -> DecodingParams:
        """The settings a row runs with (:func:`request_params`): ``max_new_tokens`` filled in and
        every field checked, a request that names no tau as it would run at ``default_tau``; raises
        ``ParamError`` naming the refused field. Such a request keeps ``tau`` None: the engine
        gives it the default as it is when the request joins the batch, and keeps it current."""
        if not prompt_ids:
            raise ParamError("the prompt is empty", "prompt", "empty_prompt")
        if params.tau is None:
            check_default_tau(params.metric, params.mode)
        max_tokens = self._max_tokens(len(prompt_ids), params.max_new_tokens)
        tau = default_tau if params.tau is None else params.tau
        settings = replace(params, tau=tau, max_new_tokens=max_tokens).validate(self.trained_block_size)
        return settings if params.tau is not None else replace(settings, tau=None)

    def _max_tokens(self, prompt_tokens: int, asked: int | None) -> int:
        """``max_tokens``: as asked, or the server's default capped by what the context has left."""
        room = None if self.context is None else self.context - prompt_tokens
        if room is not None and room < 1:
            raise ParamError(
                f"the prompt has {prompt_tokens} tokens; the model's context is {self.context}",
                "prompt",
                "context_length_exceeded",
            )
        max_tokens = asked
        if max_tokens is None:
            max_tokens = self.default_max_tokens if room is None else min(self.default_max_tokens, room)
        if not 1 <= max_tokens <= self.max_tokens_limit:
            raise ParamError(
                f"max_tokens must be in 1..{self.max_tokens_limit}, got {max_tokens}",
                "max_tokens",
                "max_tokens_exceeded" if max_tokens > 1 else "invalid_value",
            )
        if room is not None and max_tokens > room:
            raise ParamError(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"the model's context of {self.context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens
