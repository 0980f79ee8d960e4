"""The decoding loop: left-to-right sliding window over a batch of rows that advance independently.

One step, for every row at once:

    feed    [pending tokens | pad | B masks]       pending = tokens not yet in the KV cache
    read    the AR output at the last pending token and the outputs at the masks
    accept  a left-to-right prefix of those candidates (acceptance.py), stop at EOS
    commit  keep the pending tokens' keys/values, drop the masks' (cursor policy)

The three cache policies differ only in *when* pending tokens are committed to the cache:

    none    never: no cache, every step re-feeds the whole sequence (the correctness oracle)
    cursor  every step: each row feeds only what it accepted last step, rows never wait
    block   only when every row has at least ``block_cache_size`` pending tokens (the paper's
            section 4.5 scheme); a row that filled its block idles until the others catch up

A row's committed entries live at cache slots that may be interleaved with holes (columns that
were padding for that row); ``slot_valid`` masks them out and :meth:`_compact` squeezes them
away once they make up too much of the cache. Rows can join (:meth:`add`) and leave (finished
rows are dropped after each step), which is what continuous batching in the server needs.

The hot path has no Python loop over rows, positions or vocabulary; the few host syncs per step
(batch width, whether anything finished) do not grow with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..masks import decode_step_mask, for_attention
from .acceptance import accept_length, confidence, metric_code, one_token_rows

CACHE_MODES = ("none", "block", "cursor")


@dataclass
class FinishedRow:
    request_id: object
    token_ids: list[int]          # new tokens, the stop token excluded
    stopped: bool                 # ended on a stop token (else: hit max_new_tokens)
    accepted_per_step: list[int]  # tokens accepted in each forward this row took part in

    @property
    def forwards(self) -> int:
        return len(self.accepted_per_step)

    @property
    def tokens_decoded(self) -> int:
        """Tokens produced by the forwards, the stop token included (so AR decoding gives 1.0)."""
        return sum(self.accepted_per_step)


@dataclass
class RowSettings:
    tau: float = 1.0
    metric: str = "prob"
    block_size: int = 4
    max_new_tokens: int = 256


@dataclass
class BatchStats:
    forwards: int = 0             # model calls
    peak_cache_slots: int = 0     # widest the cache got (slots per row, holes included)
    peak_cache_holes: float = 0.0 # largest fraction of cache slots that were holes
    compactions: int = 0
    step_widths: list[int] = field(default_factory=list)


class DecodeBatch:
    def __init__(self, model, *, mask_token_id: int, stop_ids: list[int], pad_id: int = 0,
                 cache: str = "cursor", block_cache_size: int = 16, use_last_mask: bool = False):
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_token_id = mask_token_id
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.pad_id = pad_id
        self.cache_mode = cache
        self.block_cache_size = block_cache_size
        self.use_last_mask = use_last_mask
        self.stats = BatchStats()

        self.request_ids: list = []
        long = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(0, 0, **long)        # [rows, T] prompt then accepted tokens
        self.prompt_len = torch.zeros(0, **long)
        self.seq_len = torch.zeros(0, **long)          # prompt + accepted
        self.cached_len = torch.zeros(0, **long)       # leading tokens whose KV is in the cache
        self.max_len = torch.zeros(0, **long)          # prompt + max_new_tokens
        self.tau = torch.zeros(0, dtype=torch.float64, device=self.device)
        self.metric = torch.zeros(0, **long)
        self.max_accept = torch.zeros(0, **long)       # block size (+1 with the last mask)
        self.accept_log = torch.zeros(0, 0, **long)    # [rows, steps] tokens accepted per forward
        self.forwards = torch.zeros(0, **long)
        self.kv = None                                 # transformers Cache, or None
        self.slot_valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)

    def __len__(self) -> int:
        return len(self.request_ids)

    # ------------------------------------------------------------------ rows joining and leaving
    def add(self, prompts: list[list[int]], settings: list[RowSettings], request_ids: list) -> None:
        """Queue new rows; their prompts are fed (prefilled) by the next step."""
        if not prompts:
            return
        long = dict(dtype=torch.long, device=self.device)
        n = len(prompts)
        prompt_len = torch.tensor([len(p) for p in prompts], **long)
        max_new = torch.tensor([s.max_new_tokens for s in settings], **long)
        extra = 1 if self.use_last_mask else 0
        max_accept = torch.tensor([s.block_size + extra for s in settings], **long)
        width = int((prompt_len + max_new).max()) + int(max_accept.max()) + 1
        tokens = torch.full((n, width), self.pad_id, **long)
        for row, prompt in enumerate(prompts):  # once per request, not per step
            tokens[row, : len(prompt)] = torch.tensor(prompt, **long)

        self.tokens = _cat_padded([self.tokens, tokens], self.pad_id)
        self.accept_log = _cat_padded([self.accept_log, torch.zeros(n, int(max_new.max()) + 1, **long)], 0)
        self.prompt_len = torch.cat([self.prompt_len, prompt_len])
        self.seq_len = torch.cat([self.seq_len, prompt_len])
        self.cached_len = torch.cat([self.cached_len, torch.zeros(n, **long)])
        self.max_len = torch.cat([self.max_len, prompt_len + max_new])
        self.tau = torch.cat([self.tau, torch.tensor([s.tau for s in settings], dtype=torch.float64,
                                                     device=self.device)])
        self.metric = torch.cat([self.metric, torch.tensor([metric_code(s.metric) for s in settings], **long)])
        self.max_accept = torch.cat([self.max_accept, max_accept])
        self.forwards = torch.cat([self.forwards, torch.zeros(n, **long)])
        self.slot_valid = torch.cat([self.slot_valid, self.slot_valid.new_zeros(n, self.slot_valid.shape[1])])
        if self.kv is not None:
            for layer in _filled_layers(self.kv):
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n, *layer.keys.shape[1:])])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(n, *layer.values.shape[1:])])
        self.request_ids.extend(request_ids)

    def _keep(self, keep: torch.Tensor) -> None:
        for name in ("tokens", "prompt_len", "seq_len", "cached_len", "max_len", "tau", "metric",
                     "max_accept", "accept_log", "forwards", "slot_valid"):
            setattr(self, name, getattr(self, name)[keep])
        if not len(keep):  # an empty batch starts the next one with a fresh cache
            self.kv = None
            self.slot_valid = self.slot_valid.new_zeros(0, 0)
        elif self.kv is not None:
            for layer in _filled_layers(self.kv):
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
        keep_list = keep.tolist()
        self.request_ids = [self.request_ids[i] for i in keep_list]

    def cancel(self, request_ids) -> None:
        """Drop rows (a client went away); their slots are free from the next step on."""
        drop = set(request_ids)
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in drop]
        if len(keep) != len(self.request_ids):
            self._keep(torch.tensor(keep, dtype=torch.long, device=self.device))

    # ------------------------------------------------------------------ one forward
    def step(self) -> list[FinishedRow]:
        """Run one forward for every row; return the rows that finished."""
        if not len(self):
            return []
        rows = len(self)
        pending_len = self.seq_len - self.cached_len
        if self.cache_mode == "cursor":
            commit, idle = True, None
        elif self.cache_mode == "block":
            full = pending_len >= self.block_cache_size
            commit = bool(full.all())
            idle = None if commit else full
        else:
            commit, idle = False, None

        # Rows in one-token mode need no masks; a batch of only such rows is plain AR decoding.
        multi = ~one_token_rows(self.tau, self.metric)
        n_masks = int(self.max_accept[multi].max()) - 1 if bool(multi.any()) else 0
        width_pending = int(pending_len.max())

        cols = torch.arange(width_pending, device=self.device)
        mask_cols = torch.arange(n_masks, device=self.device)
        pending_valid = cols < pending_len[:, None]
        gather_at = (self.cached_len[:, None] + cols).clamp(max=self.tokens.shape[1] - 1)
        pending = self.tokens.gather(1, gather_at).masked_fill(~pending_valid, self.pad_id)
        input_ids = torch.cat([pending, torch.full((rows, n_masks), self.mask_token_id, device=self.device,
                                                   dtype=torch.long)], dim=1)
        position_ids = torch.cat([self.cached_len[:, None] + cols, self.seq_len[:, None] + mask_cols], dim=1)
        fed_valid = torch.cat([pending_valid, pending_valid.new_ones(rows, n_masks)], dim=1)
        attention_mask = decode_step_mask(self.slot_valid, fed_valid)
        # Candidates: the AR output at the last pending token, then one per mask.
        candidate_cols = torch.cat([(pending_len - 1)[:, None], width_pending + mask_cols[None].expand(rows, -1)],
                                   dim=1)

        if self.kv is None and self.cache_mode != "none":
            from transformers import DynamicCache

            self.kv = DynamicCache(config=self.model.config)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, position_ids=position_ids,
                             attention_mask=for_attention(attention_mask, self.model),
                             cache=self.kv, use_cache=self.kv is not None, logits_to_keep=candidate_cols)
        self.stats.forwards += 1
        self.stats.step_widths.append(input_ids.shape[1])

        candidates, conf = confidence(out.logits, self.metric)
        accept = accept_length(conf, self.tau, self.metric, self.max_accept)
        accept = torch.minimum(accept, self.max_len - self.seq_len)
        cand_idx = torch.arange(candidates.shape[1], device=self.device)
        is_stop = torch.isin(candidates, self.stop_ids) & (cand_idx < accept[:, None])
        stopped = is_stop.any(dim=1)
        accept = torch.where(stopped, is_stop.long().argmax(dim=1) + 1, accept)
        if idle is not None:
            accept = accept.masked_fill(idle, 0)

        # Writing every candidate is harmless: only tokens below seq_len are ever read.
        self.tokens.scatter_(1, self.seq_len[:, None] + cand_idx, candidates)
        took_part = accept > 0
        self.accept_log.scatter_(1, self.forwards[:, None], accept[:, None])
        self.forwards += took_part.long()
        committed_len = self.seq_len.clone()
        self.seq_len += accept

        if self.kv is not None:
            if commit:
                self.kv.crop(-n_masks)
                self.slot_valid = torch.cat([self.slot_valid, pending_valid], dim=1)
                self.cached_len = committed_len
                self._maybe_compact()
            else:
                self.kv.crop(-input_ids.shape[1])

        finished = stopped | (self.seq_len >= self.max_len)
        if not bool(finished.any()):
            return []
        return self._pop(finished, stopped)

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

        Holes are the padding columns of rows that accepted fewer tokens than the widest row. A
        gather per layer moves every row's valid slots to the front; keys carry their rotary
        positions with them, so order in the cache does not matter to attention.
        """
        slots = self.slot_valid.shape[1]
        valid = self.slot_valid.sum(dim=1)
        widest = int(valid.max()) if len(valid) else 0
        self.stats.peak_cache_slots = max(self.stats.peak_cache_slots, slots)
        if slots:
            self.stats.peak_cache_holes = max(self.stats.peak_cache_holes, 1 - float(valid.sum()) / (slots * len(valid)))
        if slots <= 2 * widest + 8:
            return
        order = (~self.slot_valid).long().argsort(dim=1, stable=True)[:, :widest]
        for layer in self.kv.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self.slot_valid = self.slot_valid.gather(1, order)
        self.stats.compactions += 1


def _filled_layers(kv):
    """Cache layers that hold tensors (a layer is empty until its first forward)."""
    return [layer for layer in kv.layers if getattr(layer, "keys", None) is not None]


def _cat_padded(tensors: list[torch.Tensor], fill) -> torch.Tensor:
    """Concatenate 2-D tensors along rows, right-padding the narrower ones."""
    width = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in tensors]
    return torch.cat(padded, dim=0)
