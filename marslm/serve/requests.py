"""What a request to the serving engine is: the options it asks for, the limits they are checked
against, the stream a handler reads and the result it ends with, and the ways it can be refused.
The engine (engine.py) runs requests; the API layer (openai.py, app.py) builds and answers them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..decode import METRICS, DecodingParams, ParamError
from ..decode.params import TAU_MODES

# The metrics whose tau lives in (0, 1] with "higher = stricter": the server's default tau applies
# to them. Entropy runs the other way (accept while H <= tau), so an entropy request names its tau.
DEFAULT_TAU_METRICS = ("prob", "margin")


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``: the caller should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class EngineStopped(Exception):
    """The engine is shutting down (or has died) and takes no new requests."""


class EngineError(Exception):
    """Decoding failed for a request (the engine itself keeps serving)."""


@dataclass
class RequestOptions:
    """What a request asks for, as the API's fields name it; ``None`` means the server's default.
    :meth:`Engine.validate` resolves the defaults and turns it into the ``DecodingParams`` a row
    runs with."""

    max_tokens: int | None = None
    tau: float | None = None  # None: follow the server's (possibly adaptive) default tau
    metric: str = "prob"
    block_size: int | None = None  # masks per step + 1; at most the block size the model was trained with
    mode: str = "threshold"  # or "lossless" (the masks draft, the next forward verifies) or "hybrid"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Result:
    token_ids: list[int]  # new tokens, the stop token excluded
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    accepted_per_step: list[int]  # tokens accepted in each forward the request took part in
    tau: float | None  # the row's tau when it finished (None: lossless)
    text: str | None = None  # set when a stop string ended it: the text before the stop string

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


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of one model on one server: its context, and ``max_tokens``'s
    default and bound."""

    context: int | None  # the model's max_position_embeddings (None: unbounded)
    default_max_tokens: int
    max_tokens_limit: int
    trained_block_size: int | None

    def resolve(self, prompt_ids: list[int], options: RequestOptions, default_tau: float) -> DecodingParams:
        """The settings a row runs with: defaults filled in, every field checked; raises
        ``ParamError`` naming the refused field."""
        if not prompt_ids:
            raise ParamError("the prompt is empty", "prompt", "empty_prompt")
        if (
            options.tau is None
            and options.metric in METRICS
            and options.metric not in DEFAULT_TAU_METRICS
            and options.mode in TAU_MODES
        ):
            raise ParamError(
                f"the server's default tau is a probability; a request with metric "
                f"{options.metric!r} must set its own tau",
                "tau",
            )
        room = None if self.context is None else self.context - len(prompt_ids)
        if room is not None and room < 1:
            raise ParamError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.context}",
                "prompt",
                "context_length_exceeded",
            )
        max_tokens = options.max_tokens
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
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"the model's context of {self.context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        tau = options.tau if options.tau is not None else default_tau
        return DecodingParams(
            tau=tau,
            metric=options.metric,
            block_size=options.block_size,
            max_new_tokens=max_tokens,
            mode=options.mode,
            temperature=options.temperature,
            top_p=options.top_p,
            top_k=options.top_k,
            seed=options.seed,
            stop=options.stop,
        ).validate(self.trained_block_size)
