"""The paper's block-level KV cache for batches (Jin et al. 2026, section 4.5).

Generation is cut into cache blocks of ``block_cache_size`` positions, aligned across the batch:

    prefill     the prompts once (left-padded); the output at each row's last token is that row's
                AR prediction for the first position of the first block
    fill        every step feeds each row's whole block so far (the tokens it accepted in this block,
                then masks up to the block's end) against the committed cache, and accepts from the
                row's first unfilled position on: the AR token first (the held prediction when the
                block is empty, else the output before that position), then the masks' predictions
                while they pass tau (acceptance.py). The block's keys/values are dropped again
    commit      once every row has filled its block (or finished), one forward over the blocks
                extends the cache and yields each row's AR prediction for the next block

Fast rows idle at block boundaries: that is the price of committing in lockstep, and why the paper
names a cursor cache (``batch.py``, ``cache="cursor"``) as future work. The scheme is threshold
decoding only and runs static batches. Masks far into a block see more masks before them than a
model trained with block size B ever saw, so their confidence, and hence the acceptance, falls off
with the distance from the last real token.
"""

from __future__ import annotations

import torch

from ..adapter import placed_masks
from ..masks import causal_step_mask, for_attention
from .acceptance import accept_length, confidence
from .params import DecodingParams, metric_code
from .rows import BatchStats, FinishedRow


class BlockCachedBatch:
    """Decodes one static batch with the paper's block cache; :meth:`run` returns the finished rows."""

    def __init__(self, model, *, mask_token_id: int, stop_ids: list[int], pad_id: int = 0, block_cache_size: int = 16):
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_token_id = mask_token_id
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.pad_id = pad_id
        self.size = block_cache_size
        self.stats = BatchStats()

    @torch.no_grad()
    def run(self, prompts: list[list[int]], settings: DecodingParams, request_ids: list) -> list[FinishedRow]:
        from transformers import DynamicCache

        rows, dev, size = len(prompts), self.device, self.size
        tau = torch.full((rows,), settings.tau, dtype=torch.float64, device=dev)
        metric = torch.full((rows,), metric_code(settings.metric), dtype=torch.long, device=dev)
        self.kv = DynamicCache(config=self.model.config)

        held, slot_valid, committed = self._prefill(prompts)
        generated = torch.zeros(rows, 0, dtype=torch.long, device=dev)
        accept_log: list[list[int]] = [[] for _ in range(rows)]
        finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        cols = torch.arange(size, device=dev)
        while True:
            room = settings.max_new_tokens - generated.shape[1]
            block = torch.full((rows, size), self.mask_token_id, dtype=torch.long, device=dev)
            placed = torch.ones(rows, size, dtype=torch.bool, device=dev)  # the masks not yet written over
            filled = torch.where(finished, size, 0)
            block_end = torch.full_like(filled, min(size, room))
            while bool((filled < block_end).any()):
                logits = self._forward(block, placed, committed, slot_valid, commit=False)
                tokens, conf = confidence(logits, metric)
                # candidate k of the block comes from the output before it; k = 0 from the held token
                cand = torch.cat([held[:, None], tokens[:, :-1]], dim=1)
                cand_conf = torch.cat([conf[:, :1], conf[:, :-1]], dim=1)
                # each row's candidates start at its first unfilled position
                order = (filled[:, None] + cols).clamp(max=size - 1)
                accept = accept_length(cand_conf.gather(1, order), tau, metric, (block_end - filled).clamp(min=1))
                accept = torch.where(filled < block_end, accept, 0)
                new = cols < accept[:, None]
                is_stop = torch.isin(cand.gather(1, order), self.stop_ids) & new
                stopped = is_stop.any(dim=1)
                accept = torch.where(stopped, is_stop.long().argmax(dim=1) + 1, accept)
                write = (cols >= filled[:, None]) & (cols < (filled + accept)[:, None])
                block = torch.where(write, cand, block)
                placed &= ~write
                for row, n in enumerate(accept.tolist()):  # host bookkeeping: once per row per step
                    if n:
                        accept_log[row].append(n)
                filled = filled + accept
                # a row that stopped is done: its block sits out the remaining fill steps
                finished |= stopped
                filled = torch.where(stopped, block_end, filled)
            kept = torch.where(cols[None, :] < block_end[:, None], block, self.pad_id)
            generated = torch.cat([generated, kept[:, : int(block_end.max())]], dim=1)
            if bool(finished.all()) or generated.shape[1] >= settings.max_new_tokens:
                break
            logits = self._forward(block, placed, committed, slot_valid, commit=True)
            held = confidence(logits[:, -1:], metric)[0][:, 0]
            slot_valid = torch.cat([slot_valid, torch.ones(rows, size, dtype=torch.bool, device=dev)], dim=1)
            committed = committed + size
        return [self._finish(request_ids[i], generated[i].tolist(), accept_log[i]) for i in range(rows)]

    def _prefill(self, prompts: list[list[int]]):
        """One forward over the left-padded prompts; returns (held AR tokens, slot validity, positions)."""
        dev, width = self.device, max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=dev)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=dev)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        valid = torch.arange(width, device=dev) >= (width - lengths)[:, None]
        positions = (torch.arange(width, device=dev) - (width - lengths)[:, None]).clamp(min=0)
        empty = torch.zeros(len(prompts), 0, dtype=torch.bool, device=dev)
        logits = self._call(ids, positions, self._mask(empty, valid), logits_to_keep=1)
        held = logits[:, -1].argmax(dim=-1)
        return held, valid, lengths

    def _forward(self, block, placed, committed, slot_valid, commit: bool) -> torch.Tensor:
        """The blocks at their rows' positions, causal among themselves, masks where ``placed``
        says; the cache keeps them only on commit."""
        rows, size = block.shape
        positions = committed[:, None] + torch.arange(size, device=self.device)
        fed_valid = torch.ones(rows, size, dtype=torch.bool, device=self.device)
        with placed_masks(self.model, placed):
            logits = self._call(block, positions, self._mask(slot_valid, fed_valid), logits_to_keep=1 if commit else 0)
        if not commit:
            self.kv.crop(-size)
        return logits

    def _mask(self, slot_valid: torch.Tensor, fed_valid: torch.Tensor) -> torch.Tensor:
        mask = causal_step_mask(slot_valid.cpu().numpy(), fed_valid.cpu().numpy())
        return torch.from_numpy(mask).to(self.device)

    def _call(self, ids, positions, mask, logits_to_keep: int) -> torch.Tensor:
        self.stats.forwards += 1
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=for_attention(mask, self.model),
            cache=self.kv,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.stats.peak_cache_slots = max(self.stats.peak_cache_slots, self.kv.get_seq_length())
        return out.logits

    def _finish(self, request_id, ids: list[int], steps: list[int]) -> FinishedRow:
        stop = set(self.stop_ids.tolist())
        end = next((i for i, t in enumerate(ids) if t in stop), None)
        if end is not None:
            return FinishedRow(request_id, ids[:end], True, steps)
        return FinishedRow(request_id, ids, False, steps)
