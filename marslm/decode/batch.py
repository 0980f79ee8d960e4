"""The decoding loop: a left-to-right sliding window over rows that advance independently.

One step, for every row at once, in four phases:

    inputs  feed [pending | draft | mask group(s)]; pending = tokens whose keys/values are not cached
    accept  threshold rows: a confident left-to-right prefix of [AR token, mask predictions]
            lossless rows:  the drafts the AR outputs confirm, then the AR token after them
    record  append the accepted tokens; lossless rows take their next draft from the masks
    commit  keep the keys/values of the real tokens, drop the masks'

Threshold mode is MARS as in the paper (acceptance.py holds the rule). Lossless mode turns the
masks into a self-drafter: the masks' predictions of one step are fed as real tokens in the next
and verified by the AR outputs there, so the output is plain AR decoding, greedy token for token
or, sampling, in distribution (sampling.py). With ``draft_groups`` a step appends one mask group
per possible number of accepted drafts (each group sees only that many drafts: the paper's
composition with speculative decoding, section 4.6), so a partial rejection still leaves a valid
draft for the next step.

Adaptive width (``adaptive_width``, off by default: every step reads its masks, the paper's rule):
a row whose masks were all refused in two steps running rests: it reads no masks for 1 step,
then, after each further refused try, for 2, 4, 8 and at most 16 steps; one accepted mask ends
the streak. A resting row decodes one token per step at the cost of a plain AR step, so off the
training distribution, where masks are rarely confident, MARS costs about what AR does. The
policy is all or nothing on purpose: the first mask a step feeds costs far more than the next
ones where a forward is overhead-bound (a CPU at small batch), so narrowing a step saves little
and loses reach. Under causal attention a mask never sees the masks after it, so resting changes
no mask's prediction; it does change the output at tau < 1: where a resting row emits the AR
token alone, the paper's sampler could have accepted mask predictions after it, and the two then
continue from different prefixes. Rows in one-token mode read no masks.

Batch limit (``mask_batch_limit``, off by default): while more rows run than this, no row reads
masks, and every row decodes one token per step, as AR. Where a forward is compute-bound (a CPU
at a large batch) a mask costs about what a token does, so masks that buy 1.5-2 tokens per
forward can make a step slower than they make it productive; vLLM's speculative decoding has the
same switch (``disable_by_batch_size``). ``marslm bench --cost-curve`` tells where it pays.

Two cache policies:

    none    no cache; every step re-feeds the whole sequence (a plain baseline, and an oracle)
    cursor  every step commits: a row feeds only what it accepted last step, rows never wait (the
            cursor cache the paper names as future work; its own block-level cache, where rows
            commit in lockstep, is ``block_cache.py``)

Keys and values live in a :class:`SlotCache` (kv.py): a step appends the same number of slots to
every row, a row that fed less leaves holes that ``slot_valid`` masks out, and :meth:`_compact`
squeezes the holes out once they are more than half of the cache. Rows join (:meth:`add`) and
leave (finished rows are dropped after each step) between steps: that is all continuous batching
needs. Rows persist in the cache's buffer, as in vLLM's input batch: a leaving row's place goes
to the last row and a joining row takes a free one, so neither copies the whole cache. A prompt
that joins running rows is cached by a forward of its own first, so that it does not widen every
row of the next step to its length. A row whose own numbers fail (a sample drawn from probabilities
that are not finite) leaves at the end of its step with ``FinishedRow.error`` set; the others go on.

Row state lives on the host, in numpy arrays, as in vLLM's input batch: on a small model a step is
a few dozen tiny array operations, each several times cheaper in numpy than as a torch op, and a
GPU would sync once per step anyway to learn what was accepted. The device runs the forward and
turns each read column into a token and a confidence (sampling rows: probabilities too), which
come back to the host; the step's inputs and mask go out in one copy each. No Python loop runs
over rows, positions or vocabulary per step, except to draw samples from per-request generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..masks import causal_step_mask, decode_step_mask, for_attention
from .acceptance import accept_length, confidence, metric_code, one_token_rows
from .kv import SlotCache
from .params import ADAPTIVE_WIDTH, DecodingParams
from .sampling import sampling_probs, speculative_accept

CACHE_MODES = ("none", "cursor")
REST_AFTER = 2  # adaptive width: refused steps in a row before a row rests from masks
MAX_PAUSE_DOUBLINGS = 4  # and it rests at most 2**4 = 16 steps between tries


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
    masked_row_steps: int = 0  # rows that took part in steps that fed masks, summed over those steps
    masked_row_tokens: int = 0  # and the tokens they accepted there


@dataclass
class _Step:
    """What the inputs phase decided, for the phases after the forward."""

    pending_len: np.ndarray  # [rows]
    pending_valid: np.ndarray  # [rows, Wp]
    draft_valid: np.ndarray  # [rows, K]
    reads: np.ndarray  # [rows] masks each row reads this step
    n_masks: int  # masks per group fed
    groups: int
    sampling: bool  # some row samples


class DecodeBatch:
    # Per-row host arrays, indexed alike; rows leave by indexing all of them at once.
    ROW_STATE = (
        "tokens",
        "prompt_len",
        "seq_len",
        "cached_len",
        "max_len",
        "tau",
        "metric",
        "temperature",
        "top_p",
        "top_k",
        "n_masks",
        "lossless",
        "draft",
        "draft_len",
        "accept_log",
        "forwards",
        "slot_valid",
        "last_accept",
        "misses",
        "pause",
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
    ):
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
        self.model = model
        self.device = dev = next(model.parameters()).device
        self.mask_token_id = mask_token_id
        self.stop_ids = np.array(stop_ids, dtype=np.int64)
        self.pad_id = pad_id
        self.cache_mode = cache
        self.use_last_mask = use_last_mask
        self.draft_groups = draft_groups
        self.adaptive_width = adaptive_width
        self.mask_batch_limit = mask_batch_limit
        self.stats = BatchStats()
        self.generator = torch.Generator(device=dev)  # for requests that name no seed
        if seed is not None:
            self.generator.manual_seed(seed)
        self.request_ids: list = []
        self.errors: dict = {}  # request id -> why its row failed in this step; it leaves at the step's end
        self.generators: list[torch.Generator | None] = []  # per row: its own seed's generator
        self.kv: SlotCache | None = None
        long = np.int64
        self.tokens = np.zeros((0, 0), long)  # [rows, room] prompt, then accepted
        self.prompt_len = np.zeros(0, long)
        self.seq_len = np.zeros(0, long)  # prompt + accepted
        self.cached_len = np.zeros(0, long)  # leading tokens with cached keys/values
        self.max_len = np.zeros(0, long)  # prompt + max_new_tokens
        self.tau = np.zeros(0, np.float64)
        self.metric = np.zeros(0, long)
        self.temperature = np.zeros(0, np.float32)
        self.top_p = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, long)
        self.n_masks = np.zeros(0, long)  # most masks this row may read per step
        self.lossless = np.zeros(0, bool)
        self.draft = np.zeros((0, 0), long)  # lossless: tokens to verify
        self.draft_len = np.zeros(0, long)
        self.accept_log = np.zeros((0, 0), long)  # [rows, steps] accepted per forward
        self.forwards = np.zeros(0, long)
        self.slot_valid = np.zeros((0, 0), bool)  # [rows, slots]
        self.last_accept = np.zeros(0, long)  # tokens each row accepted last step
        self.misses = np.zeros(0, long)  # adaptive width: steps in a row whose masks were all refused
        self.pause = np.zeros(0, long)  # steps left that read no masks
        # lossless sampling: the distributions the drafts were drawn from, on the device
        self.draft_q = torch.zeros(0, 0, 0, device=dev)

    def __len__(self) -> int:
        return len(self.request_ids)

    # ------------------------------------------------------------------ rows joining and leaving
    def add(self, prompts: list[list[int]], settings: list[DecodingParams], request_ids: list) -> None:
        """Queue new rows (``settings`` verified); the next step feeds (prefills) their prompts."""
        if not prompts:
            return
        # Everything a row needs is built before any state changes: a request whose numbers cannot
        # be held leaves the batch as it was (the engine then fails that request alone).
        generators = [_generator(s.seed, self.device) for s in settings]
        long, n = np.int64, len(prompts)
        prompt_len = np.array([len(p) for p in prompts], long)
        max_new = np.array([s.max_new_tokens for s in settings], long)
        n_masks = np.array([s.block_size - 1 + self.use_last_mask for s in settings], long)
        room = int((prompt_len + max_new).max()) + 2 * int(n_masks.max()) + 2
        tokens = np.full((n, room), self.pad_id, long)
        for row, prompt in enumerate(prompts):  # once per request, not per step
            tokens[row, : len(prompt)] = prompt

        zeros = np.zeros(n, long)
        new_rows = {
            "tokens": tokens,
            "prompt_len": prompt_len,
            "seq_len": prompt_len.copy(),
            "cached_len": zeros,
            "max_len": prompt_len + max_new,
            "tau": np.array([s.tau for s in settings], np.float64),
            "metric": np.array([metric_code(s.metric) for s in settings], long),
            "temperature": np.array([s.temperature for s in settings], np.float32),
            "top_p": np.array([s.top_p for s in settings], np.float32),
            "top_k": np.array([s.top_k for s in settings], long),
            "n_masks": n_masks,
            "lossless": np.array([s.mode == "lossless" for s in settings], bool),
            "draft": np.zeros((n, 0), long),
            "draft_len": zeros,
            "accept_log": np.zeros((n, int(max_new.max()) + 1), long),
            "forwards": zeros,
            "slot_valid": np.zeros((n, self.slot_valid.shape[1]), bool),
            "last_accept": zeros,
            "misses": zeros,
            "pause": zeros,
        }
        for name in self.ROW_STATE:
            setattr(self, name, _cat_rows(getattr(self, name), new_rows[name]))
        self.draft_q = _cat_rows(self.draft_q, self.draft_q.new_zeros(n, 0, 0))
        if self.kv is not None:
            self.kv.add_rows(n)
        self.request_ids.extend(request_ids)
        self.generators.extend(generators)

    def set_tau(self, request_ids, tau: float) -> None:
        """Change tau for running rows; it applies from the next step (no restart, no reload)."""
        wanted = set(request_ids)
        rows = [i for i, rid in enumerate(self.request_ids) if rid in wanted]
        self.tau[rows] = tau

    def new_tokens(self) -> dict:
        """Tokens each running row accepted in the last step (for streaming); finished rows are
        reported by :meth:`step` itself."""
        return {
            self.request_ids[i]: self.tokens[i, self.seq_len[i] - self.last_accept[i] : self.seq_len[i]].tolist()
            for i in np.flatnonzero(self.last_accept)
        }

    def cancel(self, request_ids) -> None:
        """Drop rows (a client went away, a stop string matched); their places are free from the next step on."""
        drop = set(request_ids)
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in drop]
        if len(keep) != len(self.request_ids):
            self._keep(np.array(keep, np.int64))

    def stop(self, request_ids) -> list[FinishedRow]:
        """End rows now, as stopped (a stop string matched): their tokens so far, and free places."""
        ending = set(request_ids)
        rows = np.array([rid in ending for rid in self.request_ids], bool)
        if not rows.any():
            return []
        return self._pop(rows, np.zeros_like(rows))

    def _keep(self, keep: np.ndarray) -> None:
        """Keep the rows ``keep`` (ascending). Kept rows move only to fill the places of rows
        that leave, from the end, so that the cache copies the fewest rows (kv.py)."""
        n = len(keep)
        holes = np.setdiff1d(np.arange(n), keep[keep < n], assume_unique=True)  # as many as kept rows >= n
        order = np.arange(n)
        order[holes] = keep[keep >= n]
        keep = order
        for name in self.ROW_STATE:
            setattr(self, name, getattr(self, name)[keep])
        on_device = self._to_device(keep)
        self.draft_q = self.draft_q[on_device]
        self.request_ids = [self.request_ids[i] for i in keep]
        self.generators = [self.generators[i] for i in keep]
        if not len(keep):  # an empty batch starts afresh: no stale cache width
            self.kv = None
            self.slot_valid = np.zeros((0, 0), bool)
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
        step, input_ids, position_ids, mask, read = self._inputs()
        logits = self._call(input_ids, position_ids, mask, self.kv, self._to_device(read))
        candidates, accept, stopped, verified, mask_tokens, probs = self._accept(step, logits)
        if step.n_masks:
            self.stats.masked_row_steps += len(self)
            self.stats.masked_row_tokens += int(accept.sum())
        seq_len_before = self.seq_len
        self._record(step, candidates, accept, verified, mask_tokens, probs)
        self._commit(step, seq_len_before, verified)
        finished = stopped | (self.seq_len >= self.max_len)
        if self.errors:
            finished |= np.array([rid in self.errors for rid in self.request_ids], bool)
        if not finished.any():
            return []
        return self._pop(finished, stopped)

    def _prefill_joining(self) -> None:
        """Rows that join running ones cache their prompts in a forward of their own.

        Fed in the step instead, a joining prompt would widen every row of that step to its length.
        The prompt's last token stays pending, so the joining row's first step is like any other.
        """
        if self.kv is None:  # no running rows (or no cache): the step itself prefills
            return
        joining = (self.cached_len == 0) & (self.prompt_len > 1)
        if not joining.any():
            return
        rows = np.flatnonzero(joining)
        lengths = self.prompt_len[rows] - 1
        width = int(lengths.max())
        valid = np.arange(width) < lengths[:, None]
        input_ids = np.where(valid, self.tokens[rows, :width], self.pad_id)
        positions = np.repeat(np.arange(width)[None], len(rows), axis=0)
        mask = causal_step_mask(np.zeros((len(rows), 0), bool), valid)
        cache = SlotCache(capacity=width)
        self._call(input_ids, positions, mask, cache, logits_to_keep=1)
        self.kv.write_rows(self._to_device(rows), cache)
        grow = width - self.slot_valid.shape[1]
        if grow > 0:
            self.slot_valid = np.concatenate([self.slot_valid, np.zeros((len(self), grow), bool)], axis=1)
        self.slot_valid[rows] = False
        self.slot_valid[rows, :width] = valid
        self.cached_len[rows] = lengths

    def _call(self, input_ids, position_ids, mask, cache, logits_to_keep) -> torch.Tensor:
        """One forward over host-built inputs (mask None: plain causal); returns the kept logits."""
        self.stats.forwards += 1
        with torch.no_grad():
            return self.model(
                input_ids=self._to_device(input_ids),
                position_ids=self._to_device(position_ids),
                attention_mask=None if mask is None else for_attention(self._to_device(mask), self.model),
                cache=cache,
                use_cache=cache is not None,
                logits_to_keep=logits_to_keep,
            ).logits

    def _inputs(self):
        """Phase 1: the fed block ``[pending | draft | groups x masks]``, its positions and mask, and
        the output columns to read (AR at the last pending token and at each draft, then every mask)."""
        rows = len(self)
        pending_len = self.seq_len - self.cached_len
        # Threshold rows in one-token mode read no masks: a batch of only those is plain AR.
        reads = np.where((self.lossless | ~one_token_rows(self.tau, self.metric)) & (self.pause == 0), self.n_masks, 0)
        if self.mask_batch_limit is not None and rows > self.mask_batch_limit:
            reads = np.zeros_like(reads)
        width_pending, n_masks = int(pending_len.max()), int(reads.max())
        draft_width = self.draft.shape[1]
        groups = draft_width + 1 if self.draft_groups else 1

        cols = np.arange(max(width_pending, draft_width, n_masks))
        pending_cols, draft_cols, mask_cols = cols[:width_pending], cols[:draft_width], cols[:n_masks]
        pending_valid = pending_cols < pending_len[:, None]
        at = np.minimum(self.cached_len[:, None] + pending_cols, self.tokens.shape[1] - 1)
        pending = np.where(pending_valid, self.tokens[np.arange(rows)[:, None], at], self.pad_id)
        draft_valid = draft_cols < self.draft_len[:, None]
        if self.draft_groups:
            group_sees = np.broadcast_to(np.arange(groups), (rows, groups))
            group_valid = group_sees <= self.draft_len[:, None]
        else:
            group_sees, group_valid = self.draft_len[:, None], np.ones((rows, 1), bool)
        input_ids = np.concatenate(
            [
                pending,
                np.where(draft_valid, self.draft, self.pad_id),
                np.full((rows, groups * n_masks), self.mask_token_id),
            ],
            axis=1,
        )
        position_ids = np.concatenate(
            [
                self.cached_len[:, None] + pending_cols,
                self.seq_len[:, None] + draft_cols,
                (self.seq_len[:, None, None] + group_sees[:, :, None] + mask_cols).reshape(rows, -1),
            ],
            axis=1,
        )
        mask = decode_step_mask(
            self.slot_valid, pending_valid, draft_valid, group_sees, group_valid, n_masks, causal_as_none=True
        )
        read = np.concatenate(
            [
                (pending_len - 1)[:, None],
                (width_pending + draft_cols)[None].repeat(rows, axis=0),
                (width_pending + draft_width + np.arange(groups * n_masks))[None].repeat(rows, axis=0),
            ],
            axis=1,
        )
        if self.kv is None and self.cache_mode != "none":
            self.kv = SlotCache(capacity=2 * (int(self.seq_len.max()) + input_ids.shape[1]))
        return (
            _Step(pending_len, pending_valid, draft_valid, reads, n_masks, groups, bool((self.temperature > 0).any())),
            input_ids,
            position_ids,
            mask,
            read,
        )

    def _accept(self, step: _Step, logits: torch.Tensor):
        """Phase 2: each row's candidates and how many of them it accepts.

        The device computes each read column's greedy token and confidence; the rest is host
        bookkeeping over ``[rows, candidates]`` (those two small arrays are the step's only
        device-to-host copies, unless rows sample). Each mode's rule runs only if a row uses it.
        """
        rows, draft_width = len(self), self.draft.shape[1]
        if logits.shape[1] == 1:  # only AR tokens, which are accepted whatever their confidence
            predicted, conf = logits.argmax(dim=-1).cpu().numpy(), None
        else:
            metric = self._to_device(self.metric)
            predicted, conf = (t.cpu().numpy() for t in confidence(logits, metric, set(self.metric.tolist())))
        mask_tokens = predicted[:, draft_width + 1 :].reshape(rows, step.groups, step.n_masks)
        probs = None
        if step.sampling:
            settings = map(self._to_device, (self.temperature, self.top_p, self.top_k))
            probs = sampling_probs(logits, *settings)

        width = max(draft_width, step.n_masks) + 1
        verified = np.zeros(rows, np.int64)
        if not self.lossless.all():
            candidates, accept = self._threshold_rule(step, predicted, conf, probs, width)
        if self.lossless.any():
            verified, lossless_candidates = self._lossless_rule(step, predicted, probs, width)
            if self.lossless.all():
                candidates, accept = lossless_candidates, verified + 1
            else:
                candidates = np.where(self.lossless[:, None], lossless_candidates, candidates)
                accept = np.where(self.lossless, verified + 1, accept)

        accept = np.minimum(accept, self.max_len - self.seq_len)
        is_stop = (candidates[:, :, None] == self.stop_ids).any(axis=2) & (np.arange(width) < accept[:, None])
        stopped = is_stop.any(axis=1)
        accept = np.where(stopped, is_stop.argmax(axis=1) + 1, accept)
        return candidates, accept, stopped, verified, mask_tokens, probs

    def _threshold_rule(self, step: _Step, predicted, conf, probs, width):
        """``[AR token, first group's masks]`` under the confidence rule; a sampling row draws its AR
        token and its masks keep the rule. Returns the candidates (``width`` columns) and accept lengths."""
        # column 0 is the AR output at the last pending token; the first mask group follows the drafts
        if step.n_masks == 0:  # the AR token alone, always accepted
            tokens, accept = predicted[:, :1].copy(), np.ones(len(self), np.int64)
        else:
            masks = self.draft.shape[1] + 1
            columns = np.concatenate([[0], np.arange(masks, masks + step.n_masks)])
            tokens = predicted[:, columns]
            accept = accept_length(conf[:, columns], self.tau, self.metric, step.reads + 1)
        sampling = (self.temperature > 0) & ~self.lossless
        if probs is not None and sampling.any():
            tokens[:, 0] = np.where(sampling, self._draw(probs[:, 0], sampling), tokens[:, 0])
        return _pad_cols(tokens, width), accept

    def _lossless_rule(self, step: _Step, predicted, probs, width):
        """The drafts the AR outputs confirm (greedy: equal to; sampling: speculative sampling),
        then the AR token after them. Returns how many drafts each row verified, and the candidates."""
        rows, draft_width = len(self), self.draft.shape[1]
        ar_tokens = predicted[:, : draft_width + 1]
        matches = (ar_tokens[:, :draft_width] == self.draft) & step.draft_valid
        verified = np.cumprod(matches, axis=1).sum(axis=1)
        correction = ar_tokens[np.arange(rows), verified]
        speculative = (self.temperature > 0) & self.lossless
        if probs is not None and speculative.any():
            q = self.draft_q
            if q.shape[1] != draft_width:  # no row drew its draft by sampling: nothing reads q
                q = probs.new_zeros(rows, draft_width, probs.shape[-1])
            uniform = self._uniform(speculative, self.draft_len, draft_width)
            draft, draft_len = self._to_device(self.draft), self._to_device(self.draft_len)
            kept, next_probs = speculative_accept(probs[:, : draft_width + 1], q, draft, draft_len, uniform)
            verified = np.where(speculative, kept.cpu().numpy(), verified)
            correction = np.where(speculative, self._draw(next_probs, speculative), correction)
        candidates = np.where(np.arange(width) == verified[:, None], correction[:, None], _pad_cols(self.draft, width))
        return verified, candidates

    def _record(self, step: _Step, candidates, accept, verified, mask_tokens, probs) -> None:
        """Phase 3: append the accepted tokens, decide which rows rest from masks, take the next drafts.

        Writing every candidate is harmless: only tokens below seq_len are read, and accepted ones
        always land below max_len, inside the row's room.
        """
        rows = np.arange(len(self))
        write_at = np.minimum(self.seq_len[:, None] + np.arange(candidates.shape[1]), self.tokens.shape[1] - 1)
        self.tokens[rows[:, None], write_at] = candidates
        self.accept_log[rows, self.forwards] = accept
        self.forwards = self.forwards + (accept > 0)
        self.last_accept = accept
        self.seq_len = self.seq_len + accept
        if self.adaptive_width:
            self._rest(step, accept, verified)
        self._next_draft(step, mask_tokens, verified, probs)

    def _rest(self, step: _Step, accept, verified) -> None:
        """Adaptive width: count each row's steps running whose masks (lossless: drafts) were all
        refused; from ``REST_AFTER`` of them on, the row rests, for twice as long after each miss."""
        had = np.where(self.lossless, self.draft_len, step.reads)
        if not had.any() and not self.pause.any():  # no row read masks or drafts, none rests
            return
        used = np.where(self.lossless, verified, accept - 1)
        missed = (had > 0) & (used == 0)
        self.misses = np.where(had > 0, np.where(missed, self.misses + 1, 0), self.misses)
        backoff = 2 ** np.minimum(np.maximum(self.misses - REST_AFTER, 0), MAX_PAUSE_DOUBLINGS)
        self.pause = np.where(missed & (self.misses >= REST_AFTER), backoff, np.maximum(self.pause - 1, 0))

    def _next_draft(self, step: _Step, mask_tokens, verified, probs) -> None:
        """Lossless rows draft from the mask group that saw exactly the drafts that were accepted.

        Without draft groups the one group saw the whole draft, so it is valid only when the
        whole draft was accepted; otherwise the next step drafts afresh. Sampling rows draw their
        drafts from the masks' distributions and keep those for the next step's verification.
        """
        rows, groups, n_masks = mask_tokens.shape
        if not self.lossless.any():  # threshold rows never draft
            if self.draft.shape[1] or self.draft_q.numel():
                self.draft, self.draft_len = np.zeros((rows, 0), np.int64), np.zeros(rows, np.int64)
                self.draft_q = self.draft_q.new_zeros(rows, 0, 0)
            return
        if self.draft_groups:
            group = np.minimum(verified, groups - 1)
            usable = self.lossless
        else:
            group = np.zeros_like(verified)
            usable = self.lossless & (verified == self.draft_len)
        chosen = mask_tokens[np.arange(rows), group]
        self.draft_len = np.where(usable, step.reads, 0)
        # only as wide as the longest usable draft: a column no row drafts would be fed as padding
        width = int(self.draft_len.max())
        speculative = self.lossless & (self.temperature > 0)
        if probs is not None and speculative.any():
            draft_width, vocab = self.draft.shape[1], probs.shape[-1]
            mask_probs = probs[:, draft_width + 1 :].reshape(rows, groups, n_masks, vocab)
            at = self._to_device(group)[:, None, None, None].expand(-1, 1, n_masks, vocab)
            q = mask_probs.gather(1, at)[:, 0]
            # each sampling row draws exactly its own draft's tokens: its samples do not depend on the batch
            wanted = speculative[:, None] & (np.arange(n_masks) < self.draft_len[:, None])
            drawn = self._draw(q.reshape(rows * n_masks, vocab), wanted.reshape(-1))
            chosen = np.where(speculative[:, None], drawn.reshape(rows, n_masks), chosen)
            self.draft_q = q[:, :width]
        elif self.draft_q.numel():
            self.draft_q = self.draft_q.new_zeros(rows, 0, 0)
        self.draft = chosen[:, :width]

    def _commit(self, step: _Step, seq_len_before, verified) -> None:
        """Phase 4: keep the fed real tokens whose context was right; drop the masks' entries."""
        if self.kv is None:
            return
        draft_width = step.draft_valid.shape[1]
        if step.n_masks:
            self.kv.crop(-step.groups * step.n_masks)
        kept_drafts = (np.arange(draft_width) < np.where(self.lossless, verified, 0)[:, None]) & step.draft_valid
        self.slot_valid = np.concatenate([self.slot_valid, step.pending_valid, kept_drafts], axis=1)
        self.cached_len = seq_len_before + kept_drafts.sum(axis=1)
        self._maybe_compact()

    # ------------------------------------------------------------------ sampling
    def _draw(self, probs: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        """One token per selected row from ``probs`` ``[n, vocab]`` (n = len(rows)), each with its
        own generator; unselected rows get 0. ``rows`` may repeat a request's row (several masks).

        A row whose draw fails is recorded in ``errors`` and draws 0: it finishes, failed, at the
        end of this step, and the other rows' draws go on. Probabilities are checked first because
        a GPU's multinomial does not raise on NaN, it aborts the whole process's device context.
        """
        out = np.zeros(len(rows), np.int64)
        per_row = len(rows) // len(self)
        valid = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).cpu().numpy()
        for i in np.flatnonzero(rows):
            row = i // per_row
            try:
                if not valid[i]:
                    raise ValueError("its sampling probabilities are not finite")
                out[i] = int(torch.multinomial(probs[i], 1, generator=self.generators[row] or self.generator)[0])
            except Exception as exc:  # noqa: BLE001 - one request's numbers must not end the others'
                self.errors.setdefault(self.request_ids[row], f"{type(exc).__name__}: {exc}")
        return out

    def _uniform(self, rows: np.ndarray, counts: np.ndarray, width: int) -> torch.Tensor:
        """``[rows, width]`` uniforms on the device; a selected row draws ``counts[row]`` of them from its generator."""
        out = torch.ones(len(self), width, device=self.device)
        for i in np.flatnonzero(rows):
            n = int(counts[i])
            out[i, :n] = torch.rand(n, generator=self.generators[i] or self.generator, device=self.device)
        return out

    # ------------------------------------------------------------------ rows finishing
    def _pop(self, finished: np.ndarray, stopped: np.ndarray) -> list[FinishedRow]:
        done = []
        for i in np.flatnonzero(finished):  # once per finished request
            ids = self.tokens[i, self.prompt_len[i] : self.seq_len[i]].tolist()
            if stopped[i]:
                ids = ids[:-1]
            steps = self.accept_log[i, : self.forwards[i]].tolist()
            rid = self.request_ids[i]
            done.append(FinishedRow(rid, ids, bool(stopped[i]), steps, self.errors.pop(rid, None)))
        self._keep(np.flatnonzero(~finished))
        return done

    # ------------------------------------------------------------------ cache holes
    def _maybe_compact(self) -> None:
        """Squeeze holes out of the cache once they are more than half of it.

        Holes are padding columns of rows that fed fewer tokens than the widest row. A gather per
        layer moves each row's valid slots to the front; keys carry their rotary positions with
        them, so slot order does not matter to attention.
        """
        slots = self.slot_valid.shape[1]
        self.stats.peak_cache_slots = max(self.stats.peak_cache_slots, slots)
        widest = int(self.cached_len.max())  # a row's valid slots are its cached tokens
        if slots <= 2 * widest + 8:
            return
        order = np.argsort(~self.slot_valid, axis=1, kind="stable")[:, :widest]
        self.kv.gather_slots(self._to_device(np.ascontiguousarray(order)))
        self.slot_valid = np.take_along_axis(self.slot_valid, order, axis=1)


def _generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _pad_cols(t: np.ndarray, width: int) -> np.ndarray:
    """Right-pad (or keep) ``t`` to at least ``width`` columns with zeros."""
    if t.shape[1] >= width:
        return t
    return np.concatenate([t, np.zeros((len(t), width - t.shape[1]), t.dtype)], axis=1)


def _cat_rows(old, new):
    """Stack ``new`` rows under ``old`` (numpy arrays or tensors), zero-padding trailing dimensions
    to the wider of the two."""
    shape = [max(a, b) for a, b in zip(old.shape[1:], new.shape[1:])]
    if isinstance(old, np.ndarray):

        def pad(a):
            if list(a.shape[1:]) == shape:
                return a
            out = np.zeros((len(a), *shape), a.dtype)
            out[(slice(None), *(slice(0, size) for size in a.shape[1:]))] = a
            return out

        return np.concatenate([pad(old), pad(new)])

    def pad_tensor(t):
        widths = [w for size, want in zip(reversed(t.shape[1:]), reversed(shape)) for w in (0, want - size)]
        return torch.nn.functional.pad(t, widths) if any(widths) else t

    return torch.cat([pad_tensor(old), pad_tensor(new)], dim=0)
