"""One step's forward: eager over the growing cache, or at fixed shapes, compiled once per bucket.

An eager step pays a fixed cost for every operation it launches, and on a small model, or an
exact-mode one whose adapter adds two tiny products per gated Linear, that cost is most of the
step. What removes it is a step whose shape repeats, so that a compiler can trace it once and
replay it (gpt-fast compiles its decode step over a static KV cache; vLLM and SGLang capture CUDA
graphs per batch size). A decoding step's shape changes with every step: its rows, its width and
its cache. With ``compile=True`` it is made to repeat:

    rows     padded to a power of two (padding rows see only themselves; their outputs are dropped)
    columns  padded to the next of a few widths (``WIDTHS``); the padding goes between the real
             tokens and the masks, sees only itself, and its keys/values are dropped with the masks'
    cache    a :class:`~.kv.StaticSlotCache`: fixed buffers written from a position tensor the
             host sets, attended over a window of a power of two slots that covers those in use,
             with an attention mask that is always a ``[rows, 1, width, window]`` tensor
    adapter  exact mode's gate is the tail gate (``MaskAdapter.tail_gate``): the masks' places are
             known on the host, so nothing in the forward depends on its data

Each bucket (rows, width, masks fed, the window, the buffers' shape) is one graph, traced with
``fullgraph=True`` the first time it is met and reused by every later step, call and request; its
first call's time is reported as compile time. The window stays a static size: as a dynamic
one, inductor's CPU step ran about 30% slower at batch 1 (docs/log/2026-12-07-fast-by-default.md).
A forward wider than the widest bucket (a prompt that starts the batch) runs the same function
eagerly, its head on the columns the step reads alone.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..adapter import adapter_of, tail_gate
from ..masks import for_attention
from .compile_policy import keep_compiled_graphs
from .inputs import StepInputs, logits_to_keep
from .kv import StaticSlotCache

# The widths a compiled step is padded to: powers of two, and one past them, so that the common
# steps of a power-of-two block B need no padding (one token; B + 1: a token and its masks;
# 2B + 1: a block fed back, or verified, and its masks). A wider step runs eagerly.
WIDTHS = (1, 2, 4, 5, 8, 9, 16, 17, 32, 33)
# dynamo's default of 8 graphs per function is fewer than one decoding run's buckets; past this
# many, a new bucket runs eagerly
RECOMPILE_LIMIT = 128
BACKEND = "inductor"  # torch.compile's backend (tests trace with "eager": the same graph, no codegen)


def bucket(width: int) -> int | None:
    """The width a step of ``width`` columns is padded to, or None: wider than any bucket."""
    return next((w for w in WIDTHS if w >= width), None)


def static_capacity(longest: int) -> int:
    """The slots of a static cache for rows of up to ``longest`` tokens: what a row can use before
    compaction squeezes its holes out (rules.py), and a step, as a power of two. Taken from a bound
    known before the first step (the call's longest prompt and answer, a server's longest request),
    so that every batch of a call, or of a server, meets the same graphs."""
    room = 2 * longest + 8 + WIDTHS[-1]
    return 1 << (room - 1).bit_length()


def row_bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


@dataclass(frozen=True)
class Padded:
    """A step's host-built inputs at a bucket's shape."""

    input_ids: np.ndarray  # [rows, width]
    position_ids: np.ndarray
    mask: np.ndarray  # [rows, 1, width, window]: what each fed column sees, cached slots first
    tail: int  # the masks: every row's last columns
    offsets: np.ndarray  # [tail] each mask's offset inside its group


def padded(step: StepInputs, *, rows: int, width: int, cached: int, capacity: int, pad_id: int) -> Padded:
    """``step`` (its mask ``[n, 1, W, cached + W]``, never None) padded to ``rows`` x ``width``
    over ``capacity`` slots (the window it attends over) whose first ``cached`` are in use.

    The padding columns go between the real tokens and the masks, so that the masks stay every
    row's last columns (the adapter's tail, one per bucket whatever the padding) and the padding
    is dropped with them after the step."""
    n, fed = step.input_ids.shape
    place = columns(step, width)
    input_ids = np.full((rows, width), pad_id, np.int64)
    input_ids[:n, place] = step.input_ids
    position_ids = np.zeros((rows, width), np.int64)
    position_ids[:n, place] = step.position_ids
    full = np.zeros((rows, 1, width, capacity), bool)
    keys = np.concatenate([np.arange(cached), cached + place])
    full[:n, 0, place[:, None], keys[None, :]] = step.mask[:, 0]
    padding = np.ones((rows, width), bool)
    padding[:n, place] = False
    full[:, 0, np.arange(width), cached + np.arange(width)] |= padding  # padding sees only itself
    return Padded(input_ids, position_ids, full, fed - step.real_valid.shape[1], step.mask_offsets)


def columns(step: StepInputs, width: int) -> np.ndarray:
    """Where each of ``step``'s fed columns goes in a step ``width`` wide (see :func:`padded`)."""
    fed, real = step.input_ids.shape[1], step.real_valid.shape[1]
    place = np.arange(fed)
    return np.where(place < real, place, place + width - fed)


class StepForward:
    """Runs the steps of one model at bucket shapes over a static cache, through the process's
    compiled function once the cache's buffers exist (else, and past the widest bucket, eagerly)."""

    def __init__(self, model, pad_id: int):
        self.model = model
        self.pad_id = pad_id
        self.compile_seconds = 0.0  # the first calls of buckets this process had not traced yet
        self.compiled_steps = 0  # steps run through a compiled graph (the rest ran eagerly)
        self.graphs: set = set()  # the buckets its compiled steps met, traced here or before

    def __call__(self, cache: StaticSlotCache, step: StepInputs, to_device) -> tuple[torch.Tensor, int]:
        """``(logits, width)``: the logits at ``step``'s read columns, and the columns fed (padding included)."""
        n, fed = step.input_ids.shape
        compiled = cache.ready and bucket(fed) is not None
        rows, width = (row_bucket(n), bucket(fed)) if compiled else (n, fed)
        cached = cache.get_seq_length()
        cache.prepare(rows, width, compiled=compiled)
        inputs = padded(step, rows=rows, width=width, cached=cached, capacity=cache.window, pad_id=self.pad_id)
        read_cols = columns(step, width)[step.read_cols]
        if not compiled:  # a prefill, or a step past the widest bucket: the head on the read columns alone
            keep = logits_to_keep(read_cols, width)
            return self.run(cache, inputs, False, to_device, keep if isinstance(keep, int) else to_device(keep)), width
        logits = self.run(cache, inputs, True, to_device)
        return logits[torch.arange(n, device=logits.device)[:, None], to_device(read_cols)], width

    def run(self, cache: StaticSlotCache, inputs: Padded, compiled: bool, to_device, keep=0) -> torch.Tensor:
        """One forward of ``inputs`` over ``cache`` (prepared for its shape), compiled or not; the
        logits of the columns ``keep`` says (the model's ``logits_to_keep``; a compiled step keeps
        every fed column: one graph whatever it reads). The cache's slots in use grow by the columns fed."""
        owner = _owner(self.model)
        args = (
            self.model,
            to_device(inputs.input_ids),
            to_device(inputs.position_ids),
            for_attention(to_device(inputs.mask), self.model),
            cache,
            owner,
            keep,
        )
        key = (BACKEND, owner, *inputs.input_ids.shape, inputs.tail, cache.window, cache.capacity)
        with torch.no_grad(), tail_gate(self.model, to_device(inputs.offsets)):
            if not compiled or key in _EAGER:
                compiled, logits = False, _forward(*args)
            elif key in _TRACED:
                logits = _compiled_forward()(*args)
            else:
                started = time.perf_counter()  # reported, never decided on
                try:
                    logits = _compiled_forward()(*args)
                    _TRACED.add(key)
                except torch._dynamo.exc.FailOnRecompileLimitHit:  # refused before it ran: run it eagerly
                    _EAGER.add(key)
                    compiled, logits = False, _forward(*args)
                self.compile_seconds += time.perf_counter() - started
        self.compiled_steps += compiled
        if compiled:
            self.graphs.add(key)
        cache.advance(inputs.input_ids.shape[1])
        return logits


def _forward(model, input_ids, position_ids, mask, cache, owner: int, keep=0):
    if owner < 0:  # read, so that a graph is kept per owner (see _owner)
        raise ValueError(owner)
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        cache=cache,
        use_cache=True,
        logits_to_keep=keep,
    )
    return out.logits


_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NUMBERS = itertools.count()


def _owner(model) -> int:
    """A number for ``model`` and the adapter on it that no other pair gets in this process. Two
    models of one shape pass each other's graph guards, and dynamo does not guard on hooks (an
    exact model's adapter): the number, read by the traced function, is what keeps them apart."""
    adapter = adapter_of(model)
    numbers = _OWNERS.setdefault(model, {})
    if id(adapter) not in numbers:
        numbers[id(adapter)] = next(_NUMBERS)
    return numbers[id(adapter)]


_COMPILED: dict = {}  # backend -> the compiled _forward
_TRACED: set = set()  # (model, bucket) pairs already traced in this process
_EAGER: set = set()  # buckets past dynamo's limit of graphs: they run eagerly


def _compiled_forward():
    """One compiled function per process: dynamo keeps its graphs per function, so every decoder,
    call and request shares the buckets already traced."""
    import torch._dynamo

    if BACKEND not in _COMPILED:
        keep_compiled_graphs()
        _COMPILED[BACKEND] = torch.compile(_forward, backend=BACKEND, fullgraph=True, dynamic=False)
    # dynamo's settings are per thread: a server warms up on one and decodes on another
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    return _COMPILED[BACKEND]
