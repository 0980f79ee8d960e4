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

Adaptive width (``adaptive_width``): a row feeds at most as many masks as its recent steps could
use. After a step that accepted every mask it read, its width doubles (up to B - 1, or B with the
last mask); otherwise it becomes one more than the masks it accepted. Under causal attention a
mask never sees the masks after it, so a narrower step predicts the same tokens and only reaches
less far; it costs nothing where a wide step is as cheap as a narrow one, and saves the unused
masks' compute where it is not (a CPU, a large batch). Rows in one-token mode read no masks.

Two cache policies:

    none    no cache; every step re-feeds the whole sequence (a plain baseline, and an oracle)
    cursor  every step commits: a row feeds only what it accepted last step, rows never wait (the
            cursor cache the paper names as future work; its own block-level cache, where rows
            commit in lockstep, is ``block_cache.py``)

Keys and values live in a :class:`SlotCache` (kv.py): a step appends the same number of slots to
every row, a row that fed less leaves holes that ``slot_valid`` masks out, and :meth:`_compact`
squeezes the holes out once they are more than half of the cache. Rows join (:meth:`add`) and
leave (finished rows are dropped after each step) between steps: that is all continuous batching
needs.

No Python loop runs over rows, positions or vocabulary per step, except to draw samples from
per-request random generators; two host syncs read the step's widths, one whether a row finished.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import decode_step_mask, for_attention
from .acceptance import accept_length, confidence, metric_code, one_token_rows
from .kv import SlotCache
from .params import DecodingParams
from .sampling import sampling_probs, speculative_accept

CACHE_MODES = ("none", "cursor")


@dataclass
class FinishedRow:
    request_id: object
    token_ids: list[int]  # new tokens, the stop token excluded
    stopped: bool  # ended on a stop token (else: hit max_new_tokens)
    accepted_per_step: list[int]  # tokens accepted in each forward this row took part in

    @property
    def forwards(self) -> int:
        return len(self.accepted_per_step)


@dataclass
class BatchStats:
    forwards: int = 0  # model calls
    peak_cache_slots: int = 0  # widest the cache got, holes included


@dataclass
class _Step:
    """What the inputs phase decided, for the phases after the forward."""

    pending_len: torch.Tensor  # [rows]
    pending_valid: torch.Tensor  # [rows, Wp]
    draft_valid: torch.Tensor  # [rows, K]
    reads: torch.Tensor  # [rows] masks each row reads this step
    n_masks: int  # masks per group fed
    groups: int


class DecodeBatch:
    # Per-row tensors, indexed alike; rows leave by indexing all of them at once.
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
        "width",
        "lossless",
        "draft",
        "draft_len",
        "draft_q",
        "accept_log",
        "forwards",
        "slot_valid",
        "last_accept",
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
        adaptive_width: bool = True,
        seed: int | None = None,
    ):
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
        self.model = model
        self.device = dev = next(model.parameters()).device
        self.mask_token_id = mask_token_id
        self.stop_ids = torch.tensor(stop_ids, device=dev)
        self.pad_id = pad_id
        self.cache_mode = cache
        self.use_last_mask = use_last_mask
        self.draft_groups = draft_groups
        self.adaptive_width = adaptive_width
        self.stats = BatchStats()
        self.generator = torch.Generator(device=dev)  # for requests that name no seed
        if seed is not None:
            self.generator.manual_seed(seed)
        self.request_ids: list = []
        self.generators: list[torch.Generator | None] = []  # per row: its own seed's generator
        self.kv: SlotCache | None = None
        long = torch.long
        empty = dict(device=dev, dtype=long)
        self.tokens = torch.zeros(0, 0, **empty)  # [rows, room] prompt, then accepted
        self.prompt_len = torch.zeros(0, **empty)
        self.seq_len = torch.zeros(0, **empty)  # prompt + accepted
        self.cached_len = torch.zeros(0, **empty)  # leading tokens with cached keys/values
        self.max_len = torch.zeros(0, **empty)  # prompt + max_new_tokens
        self.tau = torch.zeros(0, dtype=torch.float64, device=dev)
        self.metric = torch.zeros(0, **empty)
        self.temperature = torch.zeros(0, dtype=torch.float32, device=dev)
        self.top_p = torch.zeros(0, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(0, **empty)
        self.n_masks = torch.zeros(0, **empty)  # most masks this row may read per step
        self.width = torch.zeros(0, **empty)  # masks it reads now (adaptive width)
        self.lossless = torch.zeros(0, dtype=torch.bool, device=dev)
        self.draft = torch.zeros(0, 0, **empty)  # lossless: tokens to verify
        self.draft_len = torch.zeros(0, **empty)
        self.draft_q = torch.zeros(0, 0, 0, device=dev)  # lossless sampling: the drafts' distributions
        self.accept_log = torch.zeros(0, 0, **empty)  # [rows, steps] accepted per forward
        self.forwards = torch.zeros(0, **empty)
        self.slot_valid = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # [rows, slots]
        self.last_accept = torch.zeros(0, **empty)  # tokens each row accepted last step

    def __len__(self) -> int:
        return len(self.request_ids)

    # ------------------------------------------------------------------ rows joining and leaving
    def add(self, prompts: list[list[int]], settings: list[DecodingParams], request_ids: list) -> None:
        """Queue new rows (``settings`` verified); the next step feeds (prefills) their prompts."""
        if not prompts:
            return
        long, dev, n = torch.long, self.device, len(prompts)
        prompt_len = torch.tensor([len(p) for p in prompts], dtype=long, device=dev)
        max_new = torch.tensor([s.max_new_tokens for s in settings], dtype=long, device=dev)
        n_masks = torch.tensor([s.block_size - 1 + self.use_last_mask for s in settings], dtype=long, device=dev)
        room = int((prompt_len + max_new).max()) + 2 * int(n_masks.max()) + 2
        tokens = torch.full((n, room), self.pad_id, dtype=long, device=dev)
        for row, prompt in enumerate(prompts):  # once per request, not per step
            tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=long, device=dev)

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        zeros = torch.zeros(n, dtype=long, device=dev)
        new_rows = {
            "tokens": tokens,
            "prompt_len": prompt_len,
            "seq_len": prompt_len.clone(),
            "cached_len": zeros,
            "max_len": prompt_len + max_new,
            "tau": column([s.tau for s in settings], torch.float64),
            "metric": column([metric_code(s.metric) for s in settings], long),
            "temperature": column([s.temperature for s in settings], torch.float32),
            "top_p": column([s.top_p for s in settings], torch.float32),
            "top_k": column([s.top_k for s in settings], long),
            "n_masks": n_masks,
            "width": n_masks.clone(),
            "lossless": column([s.mode == "lossless" for s in settings], torch.bool),
            "draft": torch.zeros(n, 0, dtype=long, device=dev),
            "draft_len": zeros,
            "draft_q": torch.zeros(n, 0, 0, device=dev),
            "accept_log": torch.zeros(n, int(max_new.max()) + 1, dtype=long, device=dev),
            "forwards": zeros,
            "slot_valid": torch.zeros(n, self.slot_valid.shape[1], dtype=torch.bool, device=dev),
            "last_accept": zeros,
        }
        for name in self.ROW_STATE:
            old, new = getattr(self, name), new_rows[name]
            setattr(self, name, _cat_rows(old, new))
        if self.kv is not None:
            self.kv.add_rows(n)
        self.request_ids.extend(request_ids)
        self.generators.extend(_generator(s.seed, dev) for s in settings)

    def set_tau(self, request_ids, tau: float) -> None:
        """Change tau for running rows; it applies from the next step (no restart, no reload)."""
        wanted = set(request_ids)
        rows = [i for i, rid in enumerate(self.request_ids) if rid in wanted]
        if rows:
            self.tau[torch.tensor(rows, device=self.device)] = tau

    def new_tokens(self) -> dict:
        """Tokens each running row accepted in the last step (for streaming); finished rows are
        reported by :meth:`step` itself."""
        counts = self.last_accept.tolist()
        ends = self.seq_len.tolist()
        return {
            rid: self.tokens[i, ends[i] - n : ends[i]].tolist()
            for i, (rid, n) in enumerate(zip(self.request_ids, counts))
            if n
        }

    def cancel(self, request_ids) -> None:
        """Drop rows (a client went away, a stop string matched); their places are free from the next step on."""
        drop = set(request_ids)
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in drop]
        if len(keep) != len(self.request_ids):
            self._keep(torch.tensor(keep, dtype=torch.long, device=self.device))

    def stop(self, request_ids) -> list[FinishedRow]:
        """End rows now, as stopped (a stop string matched): their tokens so far, and free places."""
        ending = set(request_ids)
        rows = torch.tensor([rid in ending for rid in self.request_ids], dtype=torch.bool, device=self.device)
        if not bool(rows.any()):
            return []
        return self._pop(rows, torch.zeros_like(rows))

    def _keep(self, keep: torch.Tensor) -> None:
        for name in self.ROW_STATE:
            setattr(self, name, getattr(self, name)[keep])
        kept = keep.tolist()
        self.request_ids = [self.request_ids[i] for i in kept]
        self.generators = [self.generators[i] for i in kept]
        if not kept:  # an empty batch starts afresh: no stale cache width
            self.kv = None
            self.slot_valid = self.slot_valid.new_zeros(0, 0)
        elif self.kv is not None:
            self.kv.select_rows(keep)

    # ------------------------------------------------------------------ one forward
    def step(self) -> list[FinishedRow]:
        """Run one forward for every row; return the rows that finished."""
        if not len(self):
            return []
        step, input_ids, position_ids, mask, read = self._inputs()
        with torch.no_grad():
            logits = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=for_attention(mask, self.model),
                cache=self.kv,
                use_cache=self.kv is not None,
                logits_to_keep=read,
            ).logits
        self.stats.forwards += 1
        candidates, accept, stopped, verified, mask_tokens, probs = self._accept(step, logits)
        seq_len_before = self.seq_len
        self._record(step, candidates, accept, verified, mask_tokens, probs)
        self._commit(step, seq_len_before, verified)
        finished = stopped | (self.seq_len >= self.max_len)
        if not bool(finished.any()):
            return []
        return self._pop(finished, stopped)

    def _inputs(self):
        """Phase 1: the fed block ``[pending | draft | groups x masks]``, its positions and mask, and
        the output columns to read (AR at the last pending token and at each draft, then every mask)."""
        rows, dev = len(self), self.device
        pending_len = self.seq_len - self.cached_len
        # Threshold rows in one-token mode read no masks: a batch of only those is plain AR.
        reads = torch.where(self.lossless | ~one_token_rows(self.tau, self.metric), self.width, 0)
        width_pending, n_masks = (int(x) for x in torch.stack([pending_len.max(), reads.max()]).tolist())
        draft_width = self.draft.shape[1]
        groups = draft_width + 1 if self.draft_groups else 1

        cols = torch.arange(max(width_pending, draft_width, n_masks), device=dev)
        pending_cols, draft_cols, mask_cols = cols[:width_pending], cols[:draft_width], cols[:n_masks]
        pending_valid = pending_cols < pending_len[:, None]
        at = (self.cached_len[:, None] + pending_cols).clamp(max=self.tokens.shape[1] - 1)
        pending = self.tokens.gather(1, at).masked_fill(~pending_valid, self.pad_id)
        draft_valid = draft_cols < self.draft_len[:, None]
        if self.draft_groups:
            group_sees = torch.arange(groups, device=dev).expand(rows, -1)
            group_valid = group_sees <= self.draft_len[:, None]
        else:
            group_sees, group_valid = self.draft_len[:, None], torch.ones(rows, 1, dtype=torch.bool, device=dev)
        input_ids = torch.cat(
            [
                pending,
                self.draft.masked_fill(~draft_valid, self.pad_id),
                torch.full((rows, groups * n_masks), self.mask_token_id, device=dev),
            ],
            dim=1,
        )
        position_ids = torch.cat(
            [
                self.cached_len[:, None] + pending_cols,
                self.seq_len[:, None] + draft_cols,
                (self.seq_len[:, None, None] + group_sees[:, :, None] + mask_cols).flatten(1),
            ],
            dim=1,
        )
        mask = decode_step_mask(self.slot_valid, pending_valid, draft_valid, group_sees, group_valid, n_masks)
        read = torch.cat(
            [
                (pending_len - 1)[:, None],
                width_pending + draft_cols.expand(rows, -1),
                width_pending + draft_width + torch.arange(groups * n_masks, device=dev).expand(rows, -1),
            ],
            dim=1,
        )
        if self.kv is None and self.cache_mode != "none":
            self.kv = SlotCache(capacity=2 * (int(self.seq_len.max()) + input_ids.shape[1]))
        return (
            _Step(pending_len, pending_valid, draft_valid, reads, n_masks, groups),
            input_ids,
            position_ids,
            mask,
            read,
        )

    def _accept(self, step: _Step, logits: torch.Tensor):
        """Phase 2: each row's candidates and how many of them it accepts."""
        rows, dev = len(self), self.device
        draft_width, n_masks, groups = self.draft.shape[1], step.n_masks, step.groups
        predicted, conf = confidence(logits, self.metric)
        ar_tokens = predicted[:, : draft_width + 1]
        mask_tokens = predicted[:, draft_width + 1 :].reshape(rows, groups, n_masks)
        mask_conf = conf[:, draft_width + 1 :].reshape(rows, groups, n_masks)
        sampling = self.temperature > 0
        probs = sampling_probs(logits, self.temperature, self.top_p, self.top_k) if bool(sampling.any()) else None

        # threshold rows: [AR token, first group's masks] under the confidence rule; sampling, the
        # AR token is drawn and the masks keep the rule
        first = ar_tokens[:, 0]
        if probs is not None and bool((sampling & ~self.lossless).any()):
            first = torch.where(sampling, self._draw(probs[:, 0], sampling & ~self.lossless), first)
        threshold_candidates = torch.cat([first[:, None], mask_tokens[:, 0]], dim=1)
        threshold_conf = torch.cat([conf[:, :1], mask_conf[:, 0]], dim=1)
        threshold_accept = accept_length(threshold_conf, self.tau, self.metric, step.reads + 1)

        # lossless rows: the drafts the AR outputs confirm, then the AR token after them
        matches = (ar_tokens[:, :draft_width] == self.draft) & step.draft_valid
        verified = matches.long().cumprod(dim=1).sum(dim=1)
        correction = ar_tokens.gather(1, verified[:, None])[:, 0]
        speculative = sampling & self.lossless
        if probs is not None and bool(speculative.any()):
            q = self.draft_q
            if q.shape[1] != draft_width:  # no row drew its draft by sampling: nothing reads q
                q = probs.new_zeros(rows, draft_width, probs.shape[-1])
            uniform = self._uniform(speculative, self.draft_len, draft_width)
            kept, next_probs = speculative_accept(probs[:, : draft_width + 1], q, self.draft, self.draft_len, uniform)
            verified = torch.where(speculative, kept, verified)
            correction = torch.where(speculative, self._draw(next_probs, speculative), correction)
        cand_cols = torch.arange(max(draft_width, n_masks) + 1, device=dev)
        lossless_candidates = torch.where(
            cand_cols == verified[:, None], correction[:, None], _pad_cols(self.draft, len(cand_cols))
        )
        candidates = torch.where(
            self.lossless[:, None], lossless_candidates, _pad_cols(threshold_candidates, len(cand_cols))
        )
        accept = torch.where(self.lossless, verified + 1, threshold_accept)

        accept = torch.minimum(accept, self.max_len - self.seq_len)
        is_stop = torch.isin(candidates, self.stop_ids) & (cand_cols < accept[:, None])
        stopped = is_stop.any(dim=1)
        accept = torch.where(stopped, is_stop.long().argmax(dim=1) + 1, accept)
        return candidates, accept, stopped, verified, mask_tokens, probs

    def _record(self, step: _Step, candidates, accept, verified, mask_tokens, probs) -> None:
        """Phase 3: append the accepted tokens, adapt each row's width, take the next drafts.

        Writing every candidate is harmless: only tokens below seq_len are read, and accepted ones
        always land below max_len, inside the row's room.
        """
        cand_cols = torch.arange(candidates.shape[1], device=self.device)
        write_at = (self.seq_len[:, None] + cand_cols).clamp(max=self.tokens.shape[1] - 1)
        self.tokens.scatter_(1, write_at, candidates)
        self.accept_log.scatter_(1, self.forwards[:, None], accept[:, None])
        self.forwards += (accept > 0).long()
        self.last_accept = accept
        self.seq_len = self.seq_len + accept
        if self.adaptive_width:
            used = torch.where(self.lossless, verified, accept - 1)
            had = torch.where(self.lossless, self.draft_len, step.reads)
            grown = torch.where(used >= had, 2 * self.width, used + 1)
            self.width = torch.where(step.reads > 0, grown.clamp(min=1), self.width).minimum(self.n_masks)
        self._next_draft(step, mask_tokens, verified, probs)

    def _next_draft(self, step: _Step, mask_tokens, verified, probs) -> None:
        """Lossless rows draft from the mask group that saw exactly the drafts that were accepted.

        Without draft groups the one group saw the whole draft, so it is valid only when the
        whole draft was accepted; otherwise the next step drafts afresh. Sampling rows draw their
        drafts from the masks' distributions and keep those for the next step's verification.
        """
        rows, groups, n_masks = mask_tokens.shape
        if self.draft_groups:
            group = verified.clamp(max=groups - 1)
            usable = self.lossless
        else:
            group = torch.zeros_like(verified)
            usable = self.lossless & (verified == self.draft_len)
        chosen = mask_tokens.gather(1, group[:, None, None].expand(-1, 1, n_masks))[:, 0]
        self.draft_len = torch.where(usable, torch.minimum(step.reads, self.width), 0).clamp(max=n_masks)
        speculative = self.lossless & (self.temperature > 0)
        if probs is not None and bool(speculative.any()):
            draft_width = self.draft.shape[1]
            mask_probs = probs[:, draft_width + 1 :].reshape(rows, groups, n_masks, -1)
            q = mask_probs.gather(1, group[:, None, None, None].expand(-1, 1, n_masks, mask_probs.shape[-1]))[:, 0]
            # each sampling row draws exactly its own draft's tokens: its samples do not depend on the batch
            wanted = speculative[:, None] & (torch.arange(n_masks, device=self.device) < self.draft_len[:, None])
            drawn = self._draw(q.reshape(rows * n_masks, -1), wanted.flatten())
            chosen = torch.where(speculative[:, None], drawn.reshape(rows, n_masks), chosen)
            self.draft_q = q
        else:
            self.draft_q = self.draft_q.new_zeros(rows, 0, 0)
        self.draft = chosen

    def _commit(self, step: _Step, seq_len_before, verified) -> None:
        """Phase 4: keep the fed real tokens whose context was right; drop the masks' entries."""
        if self.kv is None:
            return
        draft_width = step.draft_valid.shape[1]
        self.kv.crop(-step.groups * step.n_masks)
        draft_cols = torch.arange(draft_width, device=self.device)
        kept_drafts = (draft_cols < torch.where(self.lossless, verified, 0)[:, None]) & step.draft_valid
        self.slot_valid = torch.cat([self.slot_valid, step.pending_valid, kept_drafts], dim=1)
        self.cached_len = seq_len_before + kept_drafts.sum(dim=1)
        self._maybe_compact()

    # ------------------------------------------------------------------ sampling
    def _draw(self, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token per selected row from ``probs`` ``[n, vocab]`` (n = len(rows)), each with its
        own generator; unselected rows get 0. ``rows`` may repeat a request's row (several masks)."""
        out = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        per_row = len(rows) // len(self)
        for i in rows.nonzero().flatten().tolist():
            generator = self.generators[i // per_row] or self.generator
            out[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
        return out

    def _uniform(self, rows: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
        """``[rows, width]`` uniforms; a selected row draws ``counts[row]`` of them from its generator."""
        out = torch.ones(len(self), width, device=self.device)
        for i in rows.nonzero().flatten().tolist():
            n = int(counts[i])
            out[i, :n] = torch.rand(n, generator=self.generators[i] or self.generator, device=self.device)
        return out

    # ------------------------------------------------------------------ rows finishing
    def _pop(self, finished: torch.Tensor, stopped: torch.Tensor) -> list[FinishedRow]:
        done = []
        for i in finished.nonzero().flatten().tolist():  # once per finished request
            start, end = int(self.prompt_len[i]), int(self.seq_len[i])
            ids = self.tokens[i, start:end].tolist()
            if bool(stopped[i]):
                ids = ids[:-1]
            done.append(
                FinishedRow(
                    self.request_ids[i], ids, bool(stopped[i]), self.accept_log[i, : int(self.forwards[i])].tolist()
                )
            )
        self._keep((~finished).nonzero().flatten())
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
        widest = int(self.slot_valid.sum(dim=1).max())
        if slots <= 2 * widest + 8:
            return
        order = (~self.slot_valid).long().argsort(dim=1, stable=True)[:, :widest]
        self.kv.gather_slots(order)
        self.slot_valid = self.slot_valid.gather(1, order)


def _generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _pad_cols(t: torch.Tensor, width: int, value: int = 0) -> torch.Tensor:
    """Right-pad (or keep) ``t`` to at least ``width`` columns."""
    return torch.nn.functional.pad(t, (0, max(0, width - t.shape[1])), value=value)


def _cat_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Stack ``new`` rows under ``old``, zero-padding trailing dimensions to the wider of the two."""
    shape = [max(a, b) for a, b in zip(old.shape[1:], new.shape[1:])]

    def pad(t):
        widths = [w for size, want in zip(reversed(t.shape[1:]), reversed(shape)) for w in (0, want - size)]
        return torch.nn.functional.pad(t, widths) if any(widths) else t

    return torch.cat([pad(old), pad(new)], dim=0)
