"""The serving engine: a request queue, a scheduler and a model runner on one background thread.

vLLM's design, small:

    submit()  (event loop)     -> waiting queue (FIFO, bounded: a full queue is refused, not grown)
    engine thread, each turn:     apply cancellations
                                  admit waiting requests while the batch has free rows
                                  give rows that follow the default tau its current value
                                  decoder.step(): ONE forward for every running row
                                  publish accepted tokens and finished requests
    publish                    -> requests.send_to_loop -> each request's asyncio.Queue

Why one thread owns the model: a model, its KV cache and the decoder are not thread-safe,
and one owner needs no locks around torch. Running it off the event loop keeps HTTP responsive
while a forward runs. Rows advance independently on the cursor cache, so admitting requests
between steps *is* continuous batching: nobody waits for a batch to drain.

Each row keeps its own tau. Requests that name no tau (tau None) follow the server's *default*
tau, which the ``TauController`` (tau.py) may move with load (adaptive policy) or an admin may
set. One method gives it to them (``_follow_default``): as they join the batch, and to running
rows through the decoder's ``set_tau`` before the next step after a change.

The decoder is any of decode/decoder.py's, behind its one interface: a ``DecodeBatch``, or with a
separate draft model (``marslm serve --draft-model``) a ``DraftedBatch``: the same turn, for one
request at a time, one drafted step per turn.

What a request is, as the engine holds it (its settings, stream, timings, result), is requests.py's.

One request's numbers never fail another's: a row that cannot join the batch, or whose sample
cannot be drawn, fails its own request and the batch goes on. Only a step that fails as a whole
(out of memory, say) fails every running request.

Greedy decoding is the default. At ``temperature`` > 0 threshold mode samples the AR token of each
step (the masks keep the confidence rule) and lossless mode samples exactly from the AR model's
distribution (decode/draws.py); a request's ``seed`` makes its sample reproducible. Stop
strings are matched here, on the decoded text, so a row ends at the step that produced one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import replace

import torch

from ..adapter import adapter_of
from ..chat import stop_token_ids
from ..decode import DecoderOptions, DecodingParams, TextStream
from ..decode.costs import MaskBatchLimit
from ..decode.decoder import Decoder, make_decoder
from ..decode.draft_model import DraftedBatch
from ..decode.run_loop import RunLoop, auto_mask_limit
from ..errors import UserError
from .config import ServeConfig, served_context
from .drafting import check_drafted_request, served_drafter
from .metrics import EngineMetrics
from .requests import (
    EngineError,
    EngineStopped,
    QueueFull,
    RequestLimits,
    RequestState,
    RequestStream,
    Result,
    send_to_loop,
)
from .tau import TauController
from .warm_up import warm_up

log = logging.getLogger("marslm.engine")

IDLE_TICK_S = 0.05  # how often an idle engine lets the tau controller restore the default


# ------------------------------------------------------------------------------------------ engine
class Engine:
    """One model copy, one decoder (decoder.py), one thread that loops admit -> step -> publish."""

    def __init__(
        self,
        model,
        tokenizer,
        config: ServeConfig | None = None,
        drafting: dict | None = None,
    ):
        """``drafting``: ``generate``'s drafter keywords (``DraftOptions.load``), or none."""
        config = config or ServeConfig()
        self.config = config
        self.model, self.tokenizer = model, tokenizer
        # a drafted decoder holds as many rows as its drafter keeps caches for (one)
        self.max_batch = DraftedBatch.max_rows if drafting else config.max_batch
        self.max_queue = config.max_queue
        from ..modeling import checkpoint_facts

        facts = checkpoint_facts(model, tokenizer)
        self.limits = RequestLimits(
            served_context(getattr(model.config, "max_position_embeddings", None), config.max_model_len),
            min(config.max_tokens, config.max_tokens_limit),
            config.max_tokens_limit,
            facts.block_size,
        )
        self.controller = TauController(
            config.tau, config.tau_policy, config.tau_floor, config.slo_ms, max_batch=self.max_batch
        )
        self.metrics = EngineMetrics()

        if facts.mask_token_id is None:
            raise UserError("the tokenizer has no mask token (<|mask|>); is this a MARS checkpoint?")
        self.decoder = DecoderOptions(
            cache="cursor",  # rows join and leave at any step
            adaptive_width=config.adaptive_width,
            mask_batch_limit=config.mask_batch_limit,
            compile=config.compile,
        )
        # exact mode's adapter acts at the mask token: no prompt may hold it
        self._gated_id = facts.mask_token_id if adapter_of(model) is not None else None
        self._batch_facts = dict(
            mask_token_id=facts.mask_token_id,
            pad_id=facts.pad_id,
            stop_ids=stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
            seed=config.seed,
        )
        self._bounds = dict(max_len=self.limits.context, most_rows=self.max_batch)
        drafted = served_drafter((model, tokenizer), drafting, config, self.decoder, facts.mask_token_id)
        self.drafting, self.drafter_card = drafted  # a drafted server's drafter, what /v1/models says of it
        self.run = RunLoop(self._new_batch())  # the loop generate runs too; its mask limit is set at start()
        self._lock = threading.Lock()  # guards the waiting queue, cancellations, metrics
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[RequestState] = deque()
        self._cancel: set[str] = set()
        self._running: dict[str, RequestState] = {}  # engine thread only
        self._active = 0
        self._ids = itertools.count()
        self._accepting = False
        self._stopping = False
        self._abort = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_pretrained(cls, path: str, config: ServeConfig | None = None) -> Engine:
        from ..modeling import cpu_threads, load_model, resolve_device

        config = config or ServeConfig()
        model, tokenizer, _ = load_model(path, dtype=config.dtype, device=resolve_device(config.device))
        drafting = config.drafting.load(config.device, config.dtype)
        if model.device.type == "cpu":
            torch.set_num_threads(cpu_threads(config.threads))
            log.info("model on the CPU with %d torch threads", torch.get_num_threads())
        return cls(model, tokenizer, config, drafting)

    # ---------------------------------------------------------------------------- lifecycle
    def _new_batch(self) -> Decoder:
        """The decoder the server runs (decoder.py), sized by ``_bounds``: every batch meets the same graphs."""
        return make_decoder(self.model, self.decoder, drafting=self.drafting, **self._bounds, **self._batch_facts)

    @property
    def _batch(self) -> Decoder:
        return self.run.decoder

    @property
    def mask_limit(self) -> MaskBatchLimit | None:
        return self.run.mask_limit

    @mask_limit.setter
    def mask_limit(self, limit: MaskBatchLimit | None) -> None:
        self.run.mask_limit = limit
        self._batch.mask_batch_limit = None if limit is None else limit.limit

    @property
    def alive(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def start(self, warmup: bool = True) -> None:
        if self._thread is not None:
            return
        if warmup:  # first-call work (allocator, kernels, the compiled step's graphs) happens here, not in a request
            warm_up(self._new_batch, self.max_batch, self._batch_facts["pad_id"], self.limits.trained_block_size)
        if self.config.mask_batch_limit == "auto" and self.mask_limit is None and self.drafting is None:
            self.mask_limit = _load_policy(self.model, self.limits.trained_block_size, self._batch, self.max_batch)
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="marslm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Take no new requests; let queued and running ones finish for up to ``timeout`` seconds,
        then cancel what is left (each waiter gets a ``cancelled`` result) and join the thread."""
        with self._lock:
            self._accepting = False
            self._stopping = True
            self._wake.notify_all()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._lock:
                self._abort = True
                self._wake.notify_all()
            self._thread.join(10.0)

    # ------------------------------------------------------------------------ submitting
    def resolve(self, prompt_ids: list[int], params: DecodingParams) -> DecodingParams:
        """Check a request (:func:`~marslm.serve.requests.request_params`) against the model, with
        its defaults filled in (tau None: it follows the default); raises ``ParamError`` naming the field."""
        settings = self.limits.resolve(prompt_ids, params, self.controller.tau)
        settings.check_prompt_ids(prompt_ids, self._gated_id)
        if self.drafting is not None:
            check_drafted_request(settings)
        return settings

    def submit(
        self, prompt_ids: list[int], params: DecodingParams, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestStream:
        """Queue a request (:func:`~marslm.serve.requests.request_params`); call from the event
        loop (or pass ``loop``). Raises ParamError, QueueFull or EngineStopped; never blocks."""
        settings = self.resolve(prompt_ids, params)
        loop = loop or asyncio.get_running_loop()
        request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(request_id, len(prompt_ids), loop)
        follows = settings.tau is None
        text = TextStream(self.tokenizer, settings.stop) if settings.stop else None
        request = RequestState(request_id, list(prompt_ids), settings, follows, text, stream, time.perf_counter())
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                self.metrics.requests["rejected"] += 1
                raise QueueFull(self.metrics.retry_after(len(self._waiting), self.max_batch))
            self._waiting.append(request)
            self._wake.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        """Drop a request (its client went away); its row is freed before the next step."""
        with self._lock:
            self._cancel.add(request_id)
            self._wake.notify()

    # ---------------------------------------------------------------------------- admin
    def set_policy(
        self, policy: str | None = None, *, tau: float | None = None, floor: float | None = None, slo_ms="keep"
    ) -> dict:
        """Change the default tau's policy or bounds (``tau``: the default, the adaptive ceiling);
        running rows that follow the default switch at the next step. Returns the new state."""
        self.controller.configure(policy=policy, tau=tau, floor=floor, slo_ms=slo_ms)
        with self._lock:
            self._wake.notify()
        return self.controller.state()

    def snapshot(self) -> dict:
        """A consistent copy of the counters and gauges, for /metrics."""
        with self._lock:
            return {
                **self.metrics.snapshot(),
                "queue_depth": len(self._waiting),
                "active_batch": self._active,
                "max_batch": self.max_batch,
                "tau": self.controller.state(),
                "drafter": self.drafter_card,
            }

    # ---------------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._abort or (self._stopping and not self._waiting and not self._running):
                    break
                if not self._running and not self._waiting and not self._cancel:
                    self._wake.wait(IDLE_TICK_S)
            try:
                self._turn()
            except Exception as exc:  # a bug or an OOM must not kill the server: fail the batch, go on
                log.exception("decoding step failed")
                self._fail_running(exc)
        self._finish_all_cancelled()

    def _turn(self) -> None:
        self._apply_cancellations()
        self._admit()
        self._follow_default(self._running.values())
        if not self._running:
            self.controller.observe(time.perf_counter(), len(self._waiting), None)
            return
        started = time.perf_counter()
        new_tokens, finished = self.run.step()  # rows a stop string ended are among the finished
        now = time.perf_counter()
        # Bookkeeping before waking anyone: a client holding its answer sees metrics that count it.
        with self._lock:
            self.metrics.forwards += 1
            self.metrics.histograms["step_latency_seconds"].observe(now - started)
            self._active = len(self._batch)
            queue_depth = len(self._waiting)
        self._publish(new_tokens, finished, now)
        self.controller.observe(now, queue_depth, 1000 * (now - started))

    def _admit(self) -> None:
        joining = []
        with self._lock:
            free = self.run.free(self.max_batch)
            while self._waiting and len(joining) < free:
                joining.append(self._waiting.popleft())
        if not joining:
            return
        now = time.perf_counter()
        self._follow_default(joining)
        for r in joining:
            r.admitted = now
        try:
            self.run.add(*_rows(joining))
        except Exception:  # noqa: BLE001 - some request's numbers; add() changed nothing: find whose
            joined = []
            for r in joining:
                try:
                    self.run.add(*_rows([r]))
                    joined.append(r)
                except Exception as exc:  # noqa: BLE001
                    self._fail_alone(r, exc)
            joining = joined
        for r in joining:
            self._running[r.id] = r
        with self._lock:
            self._active = len(self._batch)
            self.metrics.prompt_tokens += sum(len(r.prompt_ids) for r in joining)
            for r in joining:
                self.metrics.histograms["queue_wait_seconds"].observe(now - r.arrived)

    def _follow_default(self, requests) -> None:
        """The one place a request that named no tau gets the server's default tau, as it is now:
        as it joins the batch (the default may have moved while it waited) and at every step after
        the default moves (the adaptive policy, an admin). Rows not in the batch yet take it as they join."""
        tau = self.controller.tau
        moved = [r for r in requests if r.follows_default and r.settings.tau != tau]
        for r in moved:
            r.settings.tau = tau
        if moved:
            self.run.set_tau([r.id for r in moved], tau)

    def _apply_cancellations(self) -> None:
        with self._lock:
            if not self._cancel:
                return
            cancel, self._cancel = self._cancel, set()
            queued = [r for r in self._waiting if r.id in cancel]
            for r in queued:
                self._waiting.remove(r)
        running = [self._running.pop(rid) for rid in cancel if rid in self._running]
        if running:
            self.run.cancel([r.id for r in running])
        with self._lock:
            self._active = len(self._batch)
        for r in queued + running:
            self._deliver(r, r.cancelled())

    def _publish(self, new_tokens: dict, finished: list, now: float) -> None:
        by_loop: dict = {}
        for rid, ids in new_tokens.items():
            r = self._running[rid]
            r.tokens += ids
            if r.first_token is None:
                r.first_token = now
            by_loop.setdefault(r.stream.loop, []).append((r.stream.queue, ids))
        done = []
        for row in finished:
            r = self._running.pop(row.request_id)
            if row.error is not None:
                self._fail_alone(r, row.error)
                continue
            rest = row.token_ids[len(r.tokens) :]  # the finishing step's tokens are not in new_tokens()
            if rest:
                by_loop.setdefault(r.stream.loop, []).append((r.stream.queue, rest))
            if r.first_token is None:
                r.first_token = now
            result = replace(r.finished(row), mask_batch_limit=self.config.mask_batch_limit, **self._decoded_with())
            by_loop.setdefault(r.stream.loop, []).append((r.stream.queue, result))
            done.append((r, result))
        with self._lock:
            for r, result in done:
                self._count_finished(r, result, now)
        for loop, items in by_loop.items():  # one wake-up of each event loop per step
            send_to_loop(loop, items)

    def decoded_with_line(self) -> str:  # for the start line; each answer's usage names its cost table
        dtype, limit = str(next(self.model.parameters()).dtype).removeprefix("torch."), self.config.mask_batch_limit
        return f"{dtype}, {'compiled' if self._batch.stats.compiled else 'eager'}, mask batch limit {limit or 'off'}"

    def _decoded_with(self) -> dict:  # what every answer names of how it was decoded, beside its tau
        table = None if self.mask_limit is None else self.mask_limit.source
        return {"cost_table": table, "compiled": self._batch.stats.compiled}

    def _deliver(self, r: RequestState, item) -> None:
        """End a request outside the normal finish path: cancelled (a Result) or failed (an exception)."""
        with self._lock:
            if isinstance(item, Result):
                self.metrics.requests["cancelled"] += 1
                self.metrics.generation_tokens += len(r.tokens)
            elif isinstance(item, BaseException):
                self.metrics.requests["error"] += 1
        send_to_loop(r.stream.loop, [(r.stream.queue, item)])

    def _count_finished(self, r: RequestState, result: Result, now: float) -> None:
        self.metrics.count_finished(result, latency=now - r.arrived, first_token=r.first_token - r.arrived)

    def _fail_alone(self, r: RequestState, reason) -> None:
        """One request's decoding failed on its own numbers; the rest of the batch goes on."""
        log.warning("request %s failed alone: %s", r.id, reason)
        self._deliver(r, EngineError(f"decoding failed: {reason}"))

    def _fail_running(self, exc: Exception) -> None:
        failed = list(self._running.values())
        self._running.clear()
        self.run = RunLoop(self._new_batch(), self.mask_limit)  # its cache may be half-updated
        with self._lock:
            self._active = 0
        for r in failed:
            self._deliver(r, EngineError(f"decoding failed: {exc}"))

    def _finish_all_cancelled(self) -> None:
        """On exit: whatever is still queued or running ends as cancelled, so no waiter hangs."""
        with self._lock:
            left = list(self._waiting)
            self._waiting.clear()
        left += list(self._running.values())
        self._running.clear()
        if left:
            self.run.cancel([r.id for r in left])
        with self._lock:
            self._active = 0
        for r in left:
            self._deliver(r, r.cancelled())


def _rows(requests: list[RequestState]) -> tuple:
    """``RunLoop.add``'s arguments for ``requests``: their prompts, settings, ids and stop matchers."""
    return tuple(map(list, zip(*[(r.prompt_ids, r.settings, r.id, r.text) for r in requests])))


def _load_policy(model, block_size: int, batch: Decoder, max_batch: int) -> MaskBatchLimit | None:
    """``--mask-batch-limit auto``: a limit over the checkpoint's cost table (costs.mask_limit),
    which the batch's size then moves (a load policy); None, with a warning, where there is none."""
    limit = auto_mask_limit(model, batch, block_size, max_batch)
    say = log.warning if limit is None else log.info
    say(
        "mask batch limit auto: %s", "no cost table for this checkpoint, so no limit" if limit is None else limit.source
    )
    return limit
