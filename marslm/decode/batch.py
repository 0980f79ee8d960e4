"""The decoding loop: a left-to-right sliding window over rows that advance independently.

One step, for every row at once:

    feed    [pending | draft | mask group(s)]   pending = tokens whose keys/values are not cached
    read    the AR outputs at the last pending token and at each draft token, and the masks'
    accept  threshold mode: a confident left-to-right prefix of [AR token, mask predictions]
            lossless mode:  the drafts that match the AR outputs, plus the AR token after them
    commit  keep the keys/values of real tokens, drop the masks'

Threshold mode is MARS as in the paper (acceptance.py holds the rule). Lossless mode turns the
masks into a self-drafter: the masks' predictions of one step are fed as real tokens in the next
and verified by the AR outputs there, so the output is greedy AR decoding token for token. With
``draft_groups`` a step appends one mask group per possible number of accepted drafts (each
group sees only that many drafts, MARS_METHOD.md section 5), so a partial rejection still leaves
a valid draft for the next step.

Two cache policies:

    none    no cache; every step re-feeds the whole sequence (a plain baseline, and an oracle)
    cursor  every step commits: a row feeds only what it accepted last step, rows never wait (the
            cursor cache the paper names as future work; its own block-level cache, where rows
            commit in lockstep, is ``block_cache.py``)

A row's committed entries live at cache slots interleaved with holes (columns that were padding
for that row); ``slot_valid`` masks them and :meth:`_compact` squeezes them out once they are
more than half of the cache. Rows join (:meth:`add`) and leave (finished rows are dropped after
each step) between steps: that is all continuous batching needs.

No Python loop runs over rows, positions or vocabulary per step; the few host syncs per step
(widths, whether anything finished) do not grow with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..masks import decode_step_mask, for_attention
from .acceptance import accept_length, confidence, metric_code, one_token_rows

CACHE_MODES = ("none", "cursor")
MODES = ("threshold", "lossless")


@dataclass
class RowSettings:
    tau: float = 1.0
    metric: str = "prob"
    block_size: int = 4
    max_new_tokens: int = 256
    mode: str = "threshold"
    temperature: float = 0.0      # > 0: sample the step's first (AR) token; masks keep the tau rule


@dataclass
class FinishedRow:
    request_id: object
    token_ids: list[int]          # new tokens, the stop token excluded
    stopped: bool                 # ended on a stop token (else: hit max_new_tokens)
    accepted_per_step: list[int]  # tokens accepted in each forward this row took part in

    @property
    def forwards(self) -> int:
        return len(self.accepted_per_step)


@dataclass
class BatchStats:
    forwards: int = 0               # model calls
    peak_cache_slots: int = 0       # widest the cache got, holes included
    peak_cache_holes: float = 0.0   # largest share of cache slots that were holes
    compactions: int = 0
    fed_columns: int = 0            # sum over forwards of batch x width (compute proxy)


class DecodeBatch:
    # Per-row state, indexed alike; rows leave by indexing all of them at once.
    ROW_STATE = ("tokens", "prompt_len", "seq_len", "cached_len", "max_len", "tau", "metric", "temperature",
                 "n_masks", "lossless", "draft", "draft_len", "accept_log", "forwards", "slot_valid",
                 "last_accept")

    def __init__(self, model, *, mask_token_id: int, stop_ids: list[int], pad_id: int = 0,
                 cache: str = "cursor", use_last_mask: bool = True,
                 draft_groups: bool = False, seed: int | None = None):
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_token_id = mask_token_id
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.pad_id = pad_id
        self.cache_mode = cache
        self.use_last_mask = use_last_mask
        self.draft_groups = draft_groups
        self.stats = BatchStats()
        self.generator = torch.Generator(device=self.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        self.request_ids: list = []
        self.kv = None   # a transformers Cache, created at the first forward
        long, dev = torch.long, self.device
        self.tokens = torch.zeros(0, 0, dtype=long, device=dev)      # [rows, T] prompt, then accepted
        self.prompt_len = torch.zeros(0, dtype=long, device=dev)
        self.seq_len = torch.zeros(0, dtype=long, device=dev)        # prompt + accepted
        self.cached_len = torch.zeros(0, dtype=long, device=dev)     # leading tokens with cached KV
        self.max_len = torch.zeros(0, dtype=long, device=dev)        # prompt + max_new_tokens
        self.tau = torch.zeros(0, dtype=torch.float64, device=dev)
        self.metric = torch.zeros(0, dtype=long, device=dev)
        self.temperature = torch.zeros(0, dtype=torch.float32, device=dev)
        self.n_masks = torch.zeros(0, dtype=long, device=dev)        # masks this row reads per step
        self.lossless = torch.zeros(0, dtype=torch.bool, device=dev)
        self.draft = torch.zeros(0, 0, dtype=long, device=dev)       # lossless: tokens to verify
        self.draft_len = torch.zeros(0, dtype=long, device=dev)
        self.accept_log = torch.zeros(0, 0, dtype=long, device=dev)  # [rows, steps] accepted per forward
        self.forwards = torch.zeros(0, dtype=long, device=dev)
        self.slot_valid = torch.zeros(0, 0, dtype=torch.bool, device=dev)
        self.last_accept = torch.zeros(0, dtype=long, device=dev)   # tokens each row accepted last step

    def __len__(self) -> int:
        return len(self.request_ids)

    # ------------------------------------------------------------------ rows joining and leaving
    def add(self, prompts: list[list[int]], settings: list[RowSettings], request_ids: list) -> None:
        """Queue new rows; the next step feeds (prefills) their prompts."""
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

        zeros = torch.zeros(n, dtype=long, device=dev)
        new_rows = {
            "tokens": tokens, "prompt_len": prompt_len, "seq_len": prompt_len.clone(), "cached_len": zeros,
            "max_len": prompt_len + max_new,
            "tau": torch.tensor([s.tau for s in settings], dtype=torch.float64, device=dev),
            "metric": torch.tensor([metric_code(s.metric) for s in settings], dtype=long, device=dev),
            "temperature": torch.tensor([s.temperature for s in settings], dtype=torch.float32, device=dev),
            "n_masks": n_masks,
            "lossless": torch.tensor([s.mode == "lossless" for s in settings], device=dev),
            "draft": torch.zeros(n, 0, dtype=long, device=dev), "draft_len": zeros,
            "accept_log": torch.zeros(n, int(max_new.max()) + 1, dtype=long, device=dev), "forwards": zeros,
            "slot_valid": torch.zeros(n, self.slot_valid.shape[1], dtype=torch.bool, device=dev),
            "last_accept": zeros,
        }
        for name in self.ROW_STATE:
            old, new = getattr(self, name), new_rows[name]
            setattr(self, name, _cat_padded([old, new]) if old.dim() == 2 else torch.cat([old, new]))
        if self.kv is not None:
            for layer in _filled_layers(self.kv):
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n, *layer.keys.shape[1:])])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(n, *layer.values.shape[1:])])
        self.request_ids.extend(request_ids)

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
        return {rid: self.tokens[i, ends[i] - n: ends[i]].tolist()
                for i, (rid, n) in enumerate(zip(self.request_ids, counts)) if n}

    def cancel(self, request_ids) -> None:
        """Drop rows (a client went away); their places are free from the next step on."""
        drop = set(request_ids)
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in drop]
        if len(keep) != len(self.request_ids):
            self._keep(torch.tensor(keep, dtype=torch.long, device=self.device))

    def _keep(self, keep: torch.Tensor) -> None:
        for name in self.ROW_STATE:
            setattr(self, name, getattr(self, name)[keep])
        if not len(keep):   # an empty batch starts afresh: no stale cache width
            self.kv = None
            self.slot_valid = self.slot_valid.new_zeros(0, 0)
        elif self.kv is not None:
            for layer in _filled_layers(self.kv):
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
        self.request_ids = [self.request_ids[i] for i in keep.tolist()]

    # ------------------------------------------------------------------ one forward
    def step(self) -> list[FinishedRow]:
        """Run one forward for every row; return the rows that finished."""
        if not len(self):
            return []
        rows, dev = len(self), self.device
        pending_len = self.seq_len - self.cached_len

        # Threshold rows in one-token mode read no masks: a batch of only those is plain AR.
        reads_masks = self.lossless | ~one_token_rows(self.tau, self.metric)
        n_masks = int(self.n_masks[reads_masks].max()) if bool(reads_masks.any()) else 0
        draft_width = self.draft.shape[1]
        groups = draft_width + 1 if self.draft_groups else 1
        width_pending = int(pending_len.max())

        # --- inputs: [pending | draft | groups x masks]
        cols = torch.arange(width_pending, device=dev)
        draft_cols = torch.arange(draft_width, device=dev)
        mask_cols = torch.arange(n_masks, device=dev)
        pending_valid = cols < pending_len[:, None]
        at = (self.cached_len[:, None] + cols).clamp(max=self.tokens.shape[1] - 1)
        pending = self.tokens.gather(1, at).masked_fill(~pending_valid, self.pad_id)
        draft_valid = draft_cols < self.draft_len[:, None]
        if self.draft_groups:
            group_sees = torch.arange(groups, device=dev).expand(rows, -1)
            group_valid = group_sees <= self.draft_len[:, None]
        else:
            group_sees, group_valid = self.draft_len[:, None], torch.ones(rows, 1, dtype=torch.bool, device=dev)
        input_ids = torch.cat([pending, self.draft.masked_fill(~draft_valid, self.pad_id),
                               torch.full((rows, groups * n_masks), self.mask_token_id, device=dev)], dim=1)
        position_ids = torch.cat([
            self.cached_len[:, None] + cols,
            self.seq_len[:, None] + draft_cols,
            (self.seq_len[:, None, None] + group_sees[:, :, None] + mask_cols).flatten(1)], dim=1)
        attention_mask = decode_step_mask(self.slot_valid, pending_valid, draft_valid, group_sees, group_valid,
                                          n_masks)
        # Outputs we read: AR at the last pending token and at every draft token, then every mask.
        ar_cols = torch.cat([(pending_len - 1)[:, None], width_pending + draft_cols.expand(rows, -1)], dim=1)
        group_cols = width_pending + draft_width + torch.arange(groups * n_masks, device=dev).expand(rows, -1)

        if self.kv is None and self.cache_mode != "none":
            from transformers import DynamicCache

            self.kv = DynamicCache(config=self.model.config)
        with torch.no_grad():
            logits = self.model(input_ids=input_ids, position_ids=position_ids,
                                attention_mask=for_attention(attention_mask, self.model),
                                cache=self.kv, use_cache=self.kv is not None,
                                logits_to_keep=torch.cat([ar_cols, group_cols], dim=1)).logits
        self.stats.forwards += 1
        self.stats.fed_columns += input_ids.numel()

        # --- accept
        predicted, conf = confidence(logits, self.metric)
        ar_tokens, mask_tokens = predicted[:, : draft_width + 1], predicted[:, draft_width + 1:]
        mask_tokens = mask_tokens.reshape(rows, groups, n_masks)
        mask_conf = conf[:, draft_width + 1:].reshape(rows, groups, n_masks)

        # threshold rows: [AR token, first group's masks] under the confidence rule
        first = ar_tokens[:, :1]
        if bool((self.temperature > 0).any()):
            first = torch.where(self.temperature[:, None] > 0, self._sample_first(logits[:, :1]), first)
        threshold_candidates = torch.cat([first, mask_tokens[:, 0]], dim=1)
        threshold_conf = torch.cat([conf[:, :1], mask_conf[:, 0]], dim=1)
        threshold_accept = accept_length(threshold_conf, self.tau, self.metric, self.n_masks + 1)
        # lossless rows: drafts that equal the AR outputs, then the AR token after them
        matches = (ar_tokens[:, :draft_width] == self.draft) & draft_valid
        verified = matches.long().cumprod(dim=1).sum(dim=1)
        candidates = torch.where(self.lossless[:, None], _pad_cols(ar_tokens, n_masks + 1),
                                 _pad_cols(threshold_candidates, draft_width + 1))
        accept = torch.where(self.lossless, verified + 1, threshold_accept)

        accept = torch.minimum(accept, self.max_len - self.seq_len)
        cand_idx = torch.arange(candidates.shape[1], device=dev)
        is_stop = torch.isin(candidates, self.stop_ids) & (cand_idx < accept[:, None])
        stopped = is_stop.any(dim=1)
        accept = torch.where(stopped, is_stop.long().argmax(dim=1) + 1, accept)

        # --- record. Writing every candidate is harmless: only tokens below seq_len are read, and
        # accepted ones always land below max_len, inside the row's room.
        write_at = (self.seq_len[:, None] + cand_idx).clamp(max=self.tokens.shape[1] - 1)
        self.tokens.scatter_(1, write_at, candidates)
        self.accept_log.scatter_(1, self.forwards[:, None], accept[:, None])
        self.forwards += (accept > 0).long()
        self.last_accept = accept
        seq_len_before = self.seq_len
        self.seq_len = self.seq_len + accept
        self._next_draft(mask_tokens, verified, accept)

        # --- commit: fed real tokens whose context was right keep their keys/values
        if self.kv is not None:
            self.kv.crop(-groups * n_masks)
            kept_drafts = draft_cols < torch.where(self.lossless, verified, 0)[:, None]
            self.slot_valid = torch.cat([self.slot_valid, pending_valid, kept_drafts & draft_valid], dim=1)
            self.cached_len = seq_len_before + kept_drafts.sum(dim=1)
            self._maybe_compact()

        finished = stopped | (self.seq_len >= self.max_len)
        if not bool(finished.any()):
            return []
        return self._pop(finished, stopped)

    def _sample_first(self, first_logits: torch.Tensor) -> torch.Tensor:
        """Sample the AR token at temperature; masks are not resampled (they keep the tau rule)."""
        temperature = self.temperature.clamp(min=1e-5)[:, None, None]
        probs = (first_logits.float() / temperature).softmax(dim=-1)[:, 0]
        return torch.multinomial(probs, 1, generator=self.generator)

    def _next_draft(self, mask_tokens, verified, accept) -> None:
        """Lossless rows draft from the mask group that saw exactly the drafts that were accepted.

        Without draft groups the one group saw the whole draft, so it is valid only when the
        whole draft was accepted; otherwise the next step drafts afresh.
        """
        rows, groups, n_masks = mask_tokens.shape
        if self.draft_groups:
            chosen = mask_tokens.gather(1, verified.clamp(max=groups - 1)[:, None, None].expand(-1, 1, n_masks))[:, 0]
            usable = self.lossless
        else:
            chosen = mask_tokens[:, 0]
            usable = self.lossless & (verified == self.draft_len)
        new_len = torch.where(usable & (accept > 0), self.n_masks, 0)
        self.draft = chosen
        self.draft_len = new_len.clamp(max=n_masks)

    def _pop(self, finished: torch.Tensor, stopped: torch.Tensor) -> list[FinishedRow]:
        done = []
        for i in finished.nonzero().flatten().tolist():  # once per finished request
            start, end = int(self.prompt_len[i]), int(self.seq_len[i])
            ids = self.tokens[i, start:end].tolist()
            if bool(stopped[i]):
                ids = ids[:-1]
            done.append(FinishedRow(self.request_ids[i], ids, bool(stopped[i]),
                                    self.accept_log[i, : int(self.forwards[i])].tolist()))
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
        valid = self.slot_valid.sum(dim=1)
        widest = int(valid.max())
        self.stats.peak_cache_slots = max(self.stats.peak_cache_slots, slots)
        if slots:
            holes = 1 - float(valid.sum()) / (slots * len(valid))
            self.stats.peak_cache_holes = max(self.stats.peak_cache_holes, holes)
        if slots <= 2 * widest + 8:
            return
        order = (~self.slot_valid).long().argsort(dim=1, stable=True)[:, :widest]
        for layer in _filled_layers(self.kv):
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self.slot_valid = self.slot_valid.gather(1, order)
        self.stats.compactions += 1


def _filled_layers(kv):
    """Cache layers that hold tensors (a layer is empty until its first forward)."""
    return [layer for layer in kv.layers if getattr(layer, "keys", None) is not None]


def _pad_cols(t: torch.Tensor, width: int, value: int = 0) -> torch.Tensor:
    """Right-pad (or keep) ``t`` to at least ``width`` columns."""
    return torch.nn.functional.pad(t, (0, max(0, width - t.shape[1])), value=value)


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate 2-D tensors along rows, right-padding the narrower ones with zeros."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([_pad_cols(t, width) for t in tensors], dim=0)
