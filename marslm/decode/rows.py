"""The decoding batch's per-row state, declared once (as vLLM's ``InputBatch`` holds its requests').

Row i of every field belongs to one request. Rows join by stacking a :class:`RowState` built for
them under the running one (:meth:`RowState.extend`) and leave by indexing every field at once
(:meth:`RowState.keep`), so a new field is written in one place: its declaration here and its
value in :meth:`RowState.joining`.

Row state lives on the host, in numpy arrays: a step's bookkeeping is many tiny array operations,
cheaper in numpy than as torch ops, and a GPU would sync once per step anyway to learn what was
accepted. The device runs the forward and turns each read column into a token and a confidence
(sampling rows: probabilities too); the step's inputs and mask go out in one copy each. No Python
loop runs over rows, positions or vocabulary per step, except to draw samples from per-request
seeds, position by position (draws.py). Rows persist in the cache's buffer: a leaving row's place
goes to the last row and a joining row takes a free one, so neither copies the whole cache (kv.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from .params import MODE_SPECS, DecodingParams, metric_code


@dataclass
class FinishedRow:
    request_id: object
    token_ids: list[int]  # new tokens, the stop token excluded
    stopped: bool  # ended on a stop token (else: hit max_new_tokens)
    accepted_per_step: list[int]  # tokens accepted in each forward this row took part in
    error: str | None = None  # why decoding this row failed (the other rows went on without it)

    @property
    def forwards(self) -> int:
        return len(self.accepted_per_step)


@dataclass
class BatchStats:
    forwards: int = 0  # model calls
    peak_cache_slots: int = 0  # widest the cache got, holes included
    # rows that took part in steps that fed masks, summed over those steps (DecodeBatch.step: a
    # drafting row only where its last step read masks too), and the tokens they accepted there
    masked_row_steps: int = 0
    masked_row_tokens: int = 0
    drafter_forwards: int = 0  # a separate draft model's calls (draft_model.py); forwards counts the target's
    cost_table: str | None = None  # the file mask_batch_limit="auto" read its step costs from (costs.py)
    compiled: bool = False  # the step runs compiled (compile_policy.py resolved compile="auto" so)
    compile_seconds: float = 0.0  # compile=True: the first calls of buckets not traced before (forward.py)
    compiled_steps: int = 0  # compile=True: steps that ran through a compiled graph (a prefill runs eagerly)
    graphs: int = 0  # compile=True: the compiled graphs (buckets) those steps met


@dataclass
class RowState:
    request_ids: list
    seeds: np.ndarray  # what each row samples with (draws.py: its request's seed, or the decoder's)
    tokens: np.ndarray  # [rows, room] prompt, then accepted tokens
    prompt_len: np.ndarray
    seq_len: np.ndarray  # prompt + accepted
    cached_len: np.ndarray  # leading tokens with cached keys/values
    max_len: np.ndarray  # prompt + max_new_tokens
    tau: np.ndarray
    metric: np.ndarray  # acceptance.py's metric codes
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    max_masks: np.ndarray  # most masks the row may read per step
    mode: np.ndarray  # the row's mode: its place in params.MODE_SPECS (mode_code)
    draft: np.ndarray  # [rows, K] rows whose mode drafts: tokens to verify
    draft_len: np.ndarray
    accept_log: np.ndarray  # [rows, steps] tokens accepted per forward
    forwards: np.ndarray
    slot_valid: np.ndarray  # [rows, slots] which cache slots hold the row's keys/values
    last_accept: np.ndarray  # tokens accepted in the last step
    misses: np.ndarray  # adaptive width: steps running whose masks were all refused
    pause: np.ndarray  # adaptive width: steps left that read no masks
    read_masks: np.ndarray  # whether the row read masks in its last step (a drafting row: drafted)

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def drafting(self) -> np.ndarray:
        """Rows whose masks draft the next step and whose drafts are verified (lossless, hybrid)."""
        return self._mode_flags("drafts")

    @property
    def reads_tau(self) -> np.ndarray:
        """Rows whose mode's acceptance reads tau (threshold, hybrid)."""
        return self._mode_flags("reads_tau")

    def _mode_flags(self, field: str) -> np.ndarray:
        # read several times a step: kept until rows join or leave (which replace ``mode``)
        cache = self.__dict__.setdefault("_flags", {})
        if cache.get("mode") is not self.mode:
            cache.clear()
            cache["mode"] = self.mode
        if field not in cache:
            cache[field] = mode_flags(self.mode, field)
        return cache[field]

    @classmethod
    def empty(cls) -> RowState:
        return cls.joining([], [], [], np.zeros(0, np.int64), pad_id=0, use_last_mask=False, slots=0)

    @classmethod
    def joining(
        cls,
        prompts: list[list[int]],
        settings: list[DecodingParams],
        request_ids: list,
        seeds: np.ndarray,
        *,
        pad_id: int,
        use_last_mask: bool,
        slots: int,
    ) -> RowState:
        """Rows for new requests (``settings`` verified) sampling with ``seeds``, with ``slots``
        cache slots, none valid."""
        long, n = np.int64, len(prompts)
        prompt_len = np.array([len(p) for p in prompts], long)
        max_new = np.array([s.max_new_tokens for s in settings], long)
        max_masks = np.array([s.block_size - 1 + use_last_mask for s in settings], long)
        room = int((prompt_len + max_new).max(initial=0)) + 2 * int(max_masks.max(initial=0)) + 2
        tokens = np.full((n, room), pad_id, long)
        for row, prompt in enumerate(prompts):  # once per request, not per step
            tokens[row, : len(prompt)] = prompt
        zeros = np.zeros(n, long)
        return cls(
            request_ids=list(request_ids),
            seeds=np.asarray(seeds, long),
            tokens=tokens,
            prompt_len=prompt_len,
            seq_len=prompt_len.copy(),
            cached_len=zeros,
            max_len=prompt_len + max_new,
            tau=np.array([s.tau for s in settings], np.float64),
            metric=np.array([metric_code(s.metric) for s in settings], long),
            temperature=np.array([s.temperature for s in settings], np.float32),
            top_p=np.array([s.top_p for s in settings], np.float32),
            top_k=np.array([s.top_k for s in settings], long),
            max_masks=max_masks,
            mode=np.array([mode_code(s.mode) for s in settings], long),
            draft=np.zeros((n, 0), long),
            draft_len=zeros,
            accept_log=np.zeros((n, int(max_new.max(initial=-1)) + 1), long),
            forwards=zeros,
            slot_valid=np.zeros((n, slots), bool),
            last_accept=zeros,
            misses=zeros,
            pause=zeros,
            read_masks=np.zeros(n, bool),
        )

    def extend(self, new: RowState) -> None:
        """Stack ``new`` rows under these; per-row widths (room, draft, slots) pad to the wider."""
        for f in fields(self):
            setattr(self, f.name, _cat_rows(getattr(self, f.name), getattr(new, f.name)))

    def keep(self, keep: np.ndarray, device) -> torch.Tensor:
        """Keep the rows ``keep`` (ascending); returns where each kept row came from, on ``device``,
        for the cache to follow. Kept rows move only to fill the places of rows that leave, from
        the end, so that the cache copies the fewest rows."""
        n = len(keep)
        holes = np.setdiff1d(np.arange(n), keep[keep < n], assume_unique=True)  # as many as kept rows >= n
        order = np.arange(n)
        order[holes] = keep[keep >= n]
        on_device = torch.from_numpy(order).to(device, non_blocking=True)
        for f in fields(self):
            value = getattr(self, f.name)
            setattr(self, f.name, [value[i] for i in order] if isinstance(value, list) else value[order])
        return on_device


def mode_code(mode: str) -> int:
    """A mode's code in the per-row arrays: its place in ``MODE_SPECS``."""
    return list(MODE_SPECS).index(mode)


def mode_names() -> list[str]:
    """The modes by code."""
    return list(MODE_SPECS)


def mode_flags(codes: np.ndarray, field: str) -> np.ndarray:
    """Per row, one of its mode's ``Mode`` flags (``drafts``, ``reads_tau``, ``samples``)."""
    return np.array([getattr(mode, field) for mode in MODE_SPECS.values()], bool)[codes]


def _cat_rows(old, new):
    """Stack ``new`` rows under ``old`` (lists or numpy arrays), zero-padding trailing dimensions
    to the wider of the two."""
    if isinstance(old, list):
        return old + new
    shape = [max(a, b) for a, b in zip(old.shape[1:], new.shape[1:])]

    def pad(a):
        if list(a.shape[1:]) == shape:
            return a
        out = np.zeros((len(a), *shape), a.dtype)
        out[(slice(None), *(slice(0, size) for size in a.shape[1:]))] = a
        return out

    return np.concatenate([pad(old), pad(new)])
