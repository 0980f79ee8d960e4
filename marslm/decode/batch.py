"""The decoding loop: a left-to-right sliding window over rows that advance independently.

One step, for every row at once, in four phases:

    inputs  feed [pending, draft | mask group(s)]; pending = tokens whose keys/values are not cached,
            draft = tokens to verify, packed after them per row
    accept  each row by its mode's rule (rules.py's ACCEPTANCE), after drafting rows are verified:
            threshold rows: a confident left-to-right prefix of [AR token, mask predictions]
            lossless rows:  the drafts the AR outputs confirm, then the AR token after them
            hybrid rows:    as lossless, then the confident prefix of the group verification selected
    record  append the accepted tokens; rows whose mode drafts take their next draft from the masks
    commit  keep the keys/values of the real tokens, drop the masks'

Threshold mode is MARS as in the paper. Lossless mode turns the masks into a self-drafter: the
masks' predictions of one step are fed as real tokens in the next and verified by the AR outputs
there, so the output is plain AR decoding, greedy token for token or, sampling, in distribution
(sampling.py). Hybrid mode composes the two: lossless verification, then the threshold rule on
the masks after the kept drafts. What a step feeds is inputs.py's; the rules, and when a row reads
no masks (adaptive width, the batch limit), are rules.py's; the per-row state is rows.py's.

Two cache policies:

    none    no cache; every step re-feeds the whole sequence (a plain baseline, and an oracle)
    cursor  every step commits: a row feeds only what it accepted last step, rows never wait (the
            cursor cache the paper names as future work; its own block-level cache, where rows
            commit in lockstep, is ``block_cache.py``)

Keys and values live in a :class:`SlotCache` (kv.py), whose holes ``slot_valid`` masks out. With
``compile=True`` the cursor cache's step runs at a few fixed shapes over a :class:`StaticSlotCache`,
traced once per shape (forward.py); the phases around the forward are the same. Rows
join (:meth:`add`) and leave (finished rows are dropped after each step) between steps: that is
all continuous batching needs. A prompt that joins running rows is cached by a forward of its own
first, so that it does not widen every row of the next step to its length. A row whose own
numbers fail (a sample drawn from probabilities that are not finite) leaves at the end of its
step with ``FinishedRow.error`` set; the others go on.
"""

from __future__ import annotations

import numpy as np
import torch

from ..adapter import tail_gate
from ..masks import for_attention
from .acceptance import confidence
from .compile_policy import resolve_compile
from .draws import RowDraws
from .forward import StepForward, row_bucket, static_capacity
from .inputs import StepInputs, logits_to_keep, prefill_inputs, step_inputs
from .kv import SlotCache, StaticSlotCache
from .params import ADAPTIVE_WIDTH, DecoderOptions, DecodingParams
from .rows import BatchStats, FinishedRow, RowState
from .rules import (
    StepOutputs,
    accept_by_mode,
    back_off,
    compaction_order,
    cut_at_stop,
    lossless_candidates,
    masks_to_read,
    next_draft,
    pad_cols,
    tries,
    verify_drafts,
)
from .sampling import sampling_probs

SLOT_CACHE_MODES = ("none", "cursor")  # the cache policies DecodeBatch runs (block: block_cache.py)


class DecodeBatch:
    """Rows that advance independently, a forward per :meth:`step` (decoder.py's interface)."""

    joins_running = True  # continuous batching: rows join between any two steps
    max_rows = None

    @classmethod
    def with_options(
        cls,
        model,
        decoder: DecoderOptions,
        max_len: int | None = None,
        work: int | None = None,
        most_rows: int | None = None,
        **facts,
    ) -> DecodeBatch:
        """A batch that decodes as ``decoder`` says (``compile="auto"`` resolved for the model's
        device and ``work``, the tokens the call may decode, None for a server: compile_policy.py);
        ``max_len``: the longest row (prompt and answer) it will hold and ``most_rows`` the most
        rows, where known up front; ``facts``: the model's mask, stop and pad ids, a seed."""
        device = next(model.parameters()).device
        return cls(
            model,
            cache=decoder.cache,
            use_last_mask=decoder.use_last_mask,
            draft_groups=decoder.draft_groups,
            adaptive_width=decoder.adaptive_width,
            # auto: whoever steps the batch sets the limit before each step (MaskBatchLimit.step)
            mask_batch_limit=None if decoder.mask_batch_limit == "auto" else decoder.mask_batch_limit,
            compile=resolve_compile(decoder.compile, decoder.cache, device, work),
            max_len=max_len,
            most_rows=most_rows,
            **facts,
        )

    def __init__(
        self,
        model,
        *,
        mask_token_id: int,
        stop_ids: list[int],
        pad_id: int = 0,
        cache: str = "cursor",
        use_last_mask: bool = True,
        draft_groups: bool = False,
        adaptive_width: bool = ADAPTIVE_WIDTH,
        mask_batch_limit: int | None = None,
        seed: int | None = None,
        compile: bool = False,
        max_len: int | None = None,
        most_rows: int | None = None,
    ):
        if cache not in SLOT_CACHE_MODES:
            raise ValueError(f"cache must be one of {SLOT_CACHE_MODES}, got {cache!r}")
        if compile and cache != "cursor":
            raise ValueError("compile runs the cursor cache's step")
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_token_id = mask_token_id
        self.stop_ids = np.array(stop_ids, dtype=np.int64)
        self.pad_id = pad_id
        self.cache_mode = cache
        self.use_last_mask = use_last_mask
        self.draft_groups = draft_groups
        self.adaptive_width = adaptive_width
        self.mask_batch_limit = mask_batch_limit
        self.stats = BatchStats()
        self.draws = RowDraws(self.device, seed)
        self.kv: SlotCache | None = None
        self.rows = RowState.empty()
        # compile: every step at a bucket's shape over a static cache (forward.py)
        self.static = StepForward(model, pad_id) if compile else None
        self.stats.compiled = compile
        # size the static cache once, so that every step's graphs are the same ones
        self.max_len, self.most_rows = max_len, most_rows
        self._fed = 0  # the columns the last step fed, padding included: what its commit drops past the real ones

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def capacity(self) -> int | None:
        """The static cache's slots, where the step is compiled and the longest row known up front."""
        return static_capacity(self.max_len) if self.static is not None and self.max_len else None

    @property
    def reserve_rows(self) -> int:
        """The rows a static cache's buffers hold from the start: the most its steps are padded to."""
        return row_bucket(max(self.most_rows or 0, len(self.rows), 1))

    @property
    def request_ids(self) -> list:
        return self.rows.request_ids

    # ------------------------------------------------------------------ rows joining and leaving
    def add(self, prompts: list[list[int]], settings: list[DecodingParams], request_ids: list) -> None:
        """Queue new rows (``settings`` verified); the next step feeds (prefills) their prompts."""
        if not prompts:
            return
        # Built before any state changes: a request whose numbers cannot be held leaves the batch
        # as it was (the engine then fails that request alone).
        joining = RowState.joining(
            prompts,
            settings,
            request_ids,
            self.draws.row_seeds([s.seed for s in settings]),
            pad_id=self.pad_id,
            use_last_mask=self.use_last_mask,
            slots=self.rows.slot_valid.shape[1],
        )
        self.rows.extend(joining)
        if self.kv is not None:
            self.kv.add_rows(len(prompts))

    def set_tau(self, request_ids, tau: float) -> None:
        """Change tau for running rows; it applies from the next step (no restart, no reload)."""
        wanted = set(request_ids)
        self.rows.tau[[i for i, rid in enumerate(self.request_ids) if rid in wanted]] = tau

    def new_tokens(self) -> dict:
        """Tokens each running row accepted in the last step (for streaming); finished rows are
        reported by :meth:`step` itself."""
        r = self.rows
        return {
            r.request_ids[i]: r.tokens[i, r.seq_len[i] - r.last_accept[i] : r.seq_len[i]].tolist()
            for i in np.flatnonzero(r.last_accept)
        }

    def cancel(self, request_ids) -> None:
        """Drop rows (a client went away, a stop string matched); their places are free from the next step on."""
        drop = set(request_ids)
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in drop]
        if len(keep) != len(self):
            self._keep(np.array(keep, np.int64))

    def stop(self, request_ids) -> list[FinishedRow]:
        """End rows now, as stopped (a stop string matched): their tokens so far, and free places."""
        ending = set(request_ids)
        rows = np.array([rid in ending for rid in self.request_ids], bool)
        if not rows.any():
            return []
        return self._pop(rows, np.zeros_like(rows))

    def _keep(self, keep: np.ndarray) -> None:
        """Keep the rows ``keep`` (ascending), in the cache too (rows.py says where they go)."""
        on_device = self.rows.keep(keep, self.device)
        if not len(keep):  # an empty batch starts afresh: no stale cache width
            self.kv = None
            self.rows.slot_valid = np.zeros((0, 0), bool)
        elif self.kv is not None:
            self.kv.select_rows(on_device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ one forward
    def step(self) -> list[FinishedRow]:
        """Run one forward for every row; return the rows that finished."""
        if not len(self):
            return []
        self._prefill_joining()
        step = self._inputs()
        if self.static is not None:
            self.stats.forwards += 1
            logits, self._fed = self.static(self.kv, step, self._to_device)
            self.stats.compile_seconds = self.static.compile_seconds
            self.stats.compiled_steps = self.static.compiled_steps
            self.stats.graphs = len(self.static.graphs)
        else:
            keep = logits_to_keep(step.read_cols, step.input_ids.shape[1])
            keep = keep if isinstance(keep, int) else self._to_device(keep)
            logits = self._call(step.input_ids, step.position_ids, step.mask, self.kv, keep, step.mask_offsets)
            self._fed = step.input_ids.shape[1]
        candidates, accept, stopped, out = self._accept(step, logits)
        if step.masks_per_group:
            # what a drafting row's masks buy shows when their drafts are verified: its first masked
            # step after one without masks (it joined, or rested) only drafts, and counts nowhere
            counted = ~self.rows.drafting | self.rows.read_masks
            self.stats.masked_row_steps += int(counted.sum())
            self.stats.masked_row_tokens += int(accept[counted].sum())
        seq_len_before = self.rows.seq_len
        self._record(step, candidates, accept, out)
        self._commit(step, seq_len_before, out.verified)
        finished = stopped | (self.rows.seq_len >= self.rows.max_len)
        if self.draws.errors:
            finished |= np.array([rid in self.draws.errors for rid in self.request_ids], bool)
        if not finished.any():
            return []
        return self._pop(finished, stopped)

    def _prefill_joining(self) -> None:
        """Rows that join running ones cache their prompts in a forward of their own.

        Fed in the step instead, a joining prompt would widen every row of that step to its length.
        The prompt's last token stays pending, so the joining row's first step is like any other.
        """
        r = self.rows
        if self.kv is None:  # no running rows (or no cache): the step itself prefills
            return
        joining = (r.cached_len == 0) & (r.prompt_len > 1)
        if not joining.any():
            return
        rows = np.flatnonzero(joining)
        input_ids, positions, mask, valid = prefill_inputs(r, rows, self.pad_id)
        cache = SlotCache(capacity=input_ids.shape[1])
        self._call(input_ids, positions, mask, cache, logits_to_keep=1)
        self.kv.write_rows(self._to_device(rows), cache)
        width = valid.shape[1]
        if width > r.slot_valid.shape[1]:
            r.slot_valid = pad_cols(r.slot_valid, width)
        r.slot_valid[rows] = False
        r.slot_valid[rows, :width] = valid
        r.cached_len[rows] = valid.sum(axis=1)

    def _call(self, input_ids, position_ids, mask, cache, logits_to_keep, mask_offsets=None) -> torch.Tensor:
        """One forward over host-built inputs (mask None: plain causal; ``mask_offsets``: those of
        the masks, each row's last columns, None for none); returns the kept logits."""
        self.stats.forwards += 1
        with torch.no_grad(), tail_gate(self.model, None if mask_offsets is None else self._to_device(mask_offsets)):
            return self.model(
                input_ids=self._to_device(input_ids),
                position_ids=self._to_device(position_ids),
                attention_mask=None if mask is None else for_attention(self._to_device(mask), self.model),
                cache=cache,
                use_cache=cache is not None,
                logits_to_keep=logits_to_keep,
            ).logits

    def _inputs(self) -> StepInputs:
        """Phase 1 (inputs.py); the step's cache is made here, as wide as a prompt's first step needs."""
        r = self.rows
        masks_read = masks_to_read(r, self.mask_batch_limit)
        inputs = step_inputs(
            r,
            masks_read,
            draft_groups=self.draft_groups,
            pad_id=self.pad_id,
            mask_token_id=self.mask_token_id,
            causal_as_none=self.static is None,
        )
        if self.kv is None and self.static is not None:
            longest = max(int(r.max_len.max()), self.max_len or 0)
            self.kv = StaticSlotCache(static_capacity(longest), len(r), self.device, self.reserve_rows)
        elif self.kv is None and self.cache_mode != "none":
            self.kv = SlotCache(capacity=2 * (int(r.seq_len.max()) + inputs.input_ids.shape[1]))
        return inputs

    def _accept(self, step: StepInputs, logits: torch.Tensor):
        """Phase 2: each row's candidates and how many of them it accepts, by its mode's rule.

        The device computes each read column's greedy token and confidence; the rest is host
        bookkeeping over ``[rows, candidates]`` (those two small arrays are the step's only
        device-to-host copies, unless rows sample). Rows whose mode drafts are verified first
        (:meth:`_verify`); then each mode's rule runs only if a row uses it (rules.py).
        """
        r, draft_width = self.rows, self.rows.draft.shape[1]
        if logits.shape[1] == 1:  # only AR tokens, which are accepted whatever their confidence
            predicted, conf = logits.argmax(dim=-1).cpu().numpy(), None
        else:
            metric = self._to_device(r.metric)
            predicted, conf = (t.cpu().numpy() for t in confidence(logits, metric, set(r.metric.tolist())))
        probs = None
        if (r.temperature > 0).any():
            probs = sampling_probs(logits, *map(self._to_device, (r.temperature, r.top_p, r.top_k)))
        verified, checked = np.zeros(len(r), np.int64), None
        if r.drafting.any():
            verified, checked = self._verify(step, predicted, probs)
        out = StepOutputs(
            rows=r,
            predicted=predicted,
            conf=conf,
            probs=probs,
            masks_read=step.masks_read,
            mask_tokens=predicted[:, draft_width + 1 :].reshape(len(r), step.groups, step.masks_per_group),
            verified=verified,
            checked=checked,
            draft_groups=self.draft_groups,
            draw=self._draw,
        )
        # a row may accept its drafts, the AR token and a whole group of masks
        candidates, accept = accept_by_mode(out, draft_width + step.masks_per_group + 1)
        accept, stopped = cut_at_stop(candidates, np.minimum(accept, r.max_len - r.seq_len), self.stop_ids)
        return candidates, accept, stopped, out

    def _verify(self, step: StepInputs, predicted, probs):
        """Drafting rows: how many drafts the AR outputs confirm, and the kept drafts with the AR
        token after them (``[rows, K + 1]``). Greedy, an AR output is the argmax; sampling, it is
        the race winner at its position (draws.py), which a draft drawn with the same noise
        matches where it is the sample."""
        r, draft_width = self.rows, self.rows.draft.shape[1]
        ar = predicted[:, : draft_width + 1].copy()
        racing, draft = (r.temperature > 0) & r.drafting, pad_cols(r.draft, draft_width + 1)
        for j in range(draft_width + 1) if probs is not None else ():
            if not racing.any():  # a column is raced only while every draft before it was kept
                break
            ar[:, j] = np.where(racing, self._draw(probs[:, j], racing, r.seq_len + j), ar[:, j])
            racing &= (j < r.draft_len) & (ar[:, j] == draft[:, j])
        verified, correction = verify_drafts(ar, r.draft, step.draft_valid)
        return verified, lossless_candidates(r.draft, verified, correction, draft_width + 1)

    def _record(self, step: StepInputs, candidates, accept, out: StepOutputs) -> None:
        """Phase 3: append the accepted tokens, decide which rows rest from masks, take the next drafts.

        Writing every candidate is harmless: only tokens below seq_len are read, and accepted ones
        always land below max_len, inside the row's room.
        """
        r, rows = self.rows, np.arange(len(self))
        write_at = np.minimum(r.seq_len[:, None] + np.arange(candidates.shape[1]), r.tokens.shape[1] - 1)
        r.tokens[rows[:, None], write_at] = candidates
        r.accept_log[rows, r.forwards] = accept
        r.forwards = r.forwards + (accept > 0)
        r.last_accept = accept
        r.seq_len = r.seq_len + accept
        r.read_masks = step.masks_read > 0
        if self.adaptive_width:
            tried, used = tries(out, accept)
            if tried.any() or r.pause.any():
                r.misses, r.pause = back_off(r.misses, r.pause, tried, used)
        # what a drafting row accepted past its AR token (hybrid's masks; a row cut short by a stop
        # or its length finishes)
        taken = np.where(r.drafting, np.maximum(accept - out.verified - 1, 0), 0)
        r.draft, r.draft_len = next_draft(
            r,
            out.mask_tokens,
            out.verified,
            step.masks_read,
            out.probs,
            draft_groups=self.draft_groups,
            draw=self._draw,
            taken=taken,
        )

    def _commit(self, step: StepInputs, seq_len_before, verified) -> None:
        """Phase 4: keep the fed real tokens whose context was right; drop the masks' entries."""
        if self.kv is None:
            return
        r = self.rows
        if self._fed > step.real_valid.shape[1]:  # the masks' entries, and a bucket's padding
            self.kv.crop(-(self._fed - step.real_valid.shape[1]))
        kept = np.where(r.drafting, verified, 0)
        real_width = step.real_valid.shape[1]
        kept_real = step.real_valid & (np.arange(real_width) < (step.pending_len + kept)[:, None])
        r.slot_valid = np.concatenate([r.slot_valid, kept_real], axis=1)
        r.cached_len = seq_len_before + kept
        self._maybe_compact()

    def _draw(self, probs: torch.Tensor, selected: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One token per selected entry of ``probs`` (rows, or a row's candidates), each raced at
        its position (draws.py)."""
        return self.draws.tokens(probs, selected, self.rows.seeds, positions, self.rows.request_ids)

    # ------------------------------------------------------------------ rows finishing
    def _pop(self, finished: np.ndarray, stopped: np.ndarray) -> list[FinishedRow]:
        r, done = self.rows, []
        for i in np.flatnonzero(finished):  # once per finished request
            ids = r.tokens[i, r.prompt_len[i] : r.seq_len[i]].tolist()
            if stopped[i]:
                ids = ids[:-1]
            steps = r.accept_log[i, : r.forwards[i]].tolist()
            rid = r.request_ids[i]
            done.append(FinishedRow(rid, ids, bool(stopped[i]), steps, self.draws.errors.pop(rid, None)))
        self._keep(np.flatnonzero(~finished))
        return done

    def _maybe_compact(self) -> None:
        """Squeeze the cache's holes out (rules.compaction_order says when); a gather per layer."""
        r = self.rows
        self.stats.peak_cache_slots = max(self.stats.peak_cache_slots, r.slot_valid.shape[1])
        order = compaction_order(r.slot_valid, r.cached_len)
        if order is not None:
            self.kv.gather_slots(self._to_device(order))
            r.slot_valid = np.take_along_axis(r.slot_valid, order, axis=1)
