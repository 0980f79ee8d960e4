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

Each :meth:`BlockCachedBatch.step` is one of those forwards, behind the interface every decoder
shares (decoder.py). Rows join only an empty batch: the blocks are aligned, so a batch runs until
its last row ends, and a finished or stopped row sits out the rest. Fast rows idle at block
boundaries: that is the price of committing in lockstep, and why the paper names a cursor cache
(``batch.py``, ``cache="cursor"``) as future work. The scheme is greedy threshold decoding. Masks
far into a block see more masks before them than a model trained with block size B ever saw, so
their confidence, and hence the acceptance, falls off with the distance from the last real token.
"""

from __future__ import annotations

import torch

from ..adapter import placed_masks
from ..masks import causal_step_mask, for_attention
from .acceptance import accept_length, confidence
from .params import DecodingParams, metric_code
from .rows import BatchStats, FinishedRow


class BlockCachedBatch:
    """One static batch decoded with the paper's block cache, a forward per :meth:`step`."""

    joins_running = False  # rows join an empty batch only (the blocks are aligned)
    max_rows = None
    mask_batch_limit = None  # every fill step reads its whole block

    def __init__(self, model, *, mask_token_id: int, stop_ids: list[int], pad_id: int = 0, block_cache_size: int = 16):
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_token_id = mask_token_id
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.pad_id = pad_id
        self.size = block_cache_size
        self.stats = BatchStats()
        self._reset()

    def _reset(self) -> None:
        self.request_ids: list = []
        self.ids: list[list[int]] = []  # each row's accepted tokens, in order (a stop token included)
        self.accept_log: list[list[int]] = []
        self.reported: list[bool] = []  # rows already returned (finished, stopped or cancelled)
        self.kv = None  # None until the prompts are cached: the next step prefills
        self._last: dict = {}

    def __len__(self) -> int:
        return self.reported.count(False)

    # ------------------------------------------------------------------ rows joining and leaving
    def add(self, prompts: list[list[int]], settings: list[DecodingParams], request_ids: list) -> None:
        """Start a batch (``settings`` verified: greedy threshold mode); refused while one runs."""
        if not prompts:
            return
        if self.request_ids:
            raise ValueError("the block cache decodes static batches: rows join an empty batch only")
        dev = self.device
        self.prompts, self.request_ids = [list(p) for p in prompts], list(request_ids)
        self.ids, self.accept_log = [[] for _ in prompts], [[] for _ in prompts]
        self.reported = [False] * len(prompts)
        self.tau = torch.tensor([s.tau for s in settings], dtype=torch.float64, device=dev)
        self.metric = torch.tensor([metric_code(s.metric) for s in settings], dtype=torch.long, device=dev)
        self.max_new = torch.tensor([s.max_new_tokens for s in settings], device=dev)
        self.finished = torch.zeros(len(prompts), dtype=torch.bool, device=dev)

    def set_tau(self, request_ids, tau: float) -> None:
        """Change tau for running rows; it applies from the next step."""
        for i in self._rows_of(request_ids):
            self.tau[i] = tau

    def new_tokens(self) -> dict:
        """Tokens each running row accepted in the last step (finished rows are reported by :meth:`step`)."""
        return dict(self._last)

    def stop(self, request_ids) -> list[FinishedRow]:
        """End rows now, as stopped (a stop string matched): their tokens so far."""
        return self._end(self._rows_of(request_ids))

    def cancel(self, request_ids) -> None:
        self.stop(request_ids)

    def _rows_of(self, request_ids) -> list[int]:
        wanted = set(request_ids)
        return [i for i, rid in enumerate(self.request_ids) if rid in wanted]

    # ------------------------------------------------------------------ one forward
    @torch.no_grad()
    def step(self) -> list[FinishedRow]:
        """The batch's next forward: the prefill, a fill step or a commit; returns the rows that ended."""
        self._last = {}
        if not len(self):
            return []
        if self.kv is None:
            self._prefill()
            self._start_block()
            return []
        if bool((self.filled < self.block_end).any()):
            return self._fill()
        ended = self._close_block()  # where rows stopped from outside ended the block's filling
        if len(self):
            self._commit()
            self._start_block()
        return ended

    def _prefill(self) -> None:
        """One forward over the left-padded prompts; holds each row's AR token for the first block."""
        from transformers import DynamicCache

        dev, prompts = self.device, self.prompts
        self.kv, width = DynamicCache(config=self.model.config), max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=dev)
        for row, prompt in enumerate(prompts):  # once per request
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=dev)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        self.slot_valid = torch.arange(width, device=dev) >= (width - lengths)[:, None]
        positions = (torch.arange(width, device=dev) - (width - lengths)[:, None]).clamp(min=0)
        empty = torch.zeros(len(prompts), 0, dtype=torch.bool, device=dev)
        logits = self._call(ids, positions, self._mask(empty, self.slot_valid), logits_to_keep=1)
        self.held, self.committed = logits[:, -1].argmax(dim=-1), lengths
        self.generated = 0  # positions of the committed blocks, the same for every row

    def _start_block(self) -> None:
        """A block of masks; each unfinished row fills it up to its room."""
        rows, size = len(self.request_ids), self.size
        self.block = torch.full((rows, size), self.mask_token_id, dtype=torch.long, device=self.device)
        self.placed = torch.ones(rows, size, dtype=torch.bool, device=self.device)  # masks not yet written over
        self.block_end = (self.max_new - self.generated).clamp(0, size)
        self.filled = torch.where(self.finished, self.block_end, 0)
        self.closed = False  # whether the block's positions are counted in ``generated``

    def _fill(self) -> list[FinishedRow]:
        """One fill forward: each filling row accepts the AR token, then its confident masks."""
        cols, size = torch.arange(self.size, device=self.device), self.size
        logits = self._forward(commit=False)
        tokens, conf = confidence(logits, self.metric)
        # candidate k of the block comes from the output before it; k = 0 from the held token
        cand = torch.cat([self.held[:, None], tokens[:, :-1]], dim=1)
        cand_conf = torch.cat([conf[:, :1], conf[:, :-1]], dim=1)
        # each row's candidates start at its first unfilled position
        order = (self.filled[:, None] + cols).clamp(max=size - 1)
        filling = self.filled < self.block_end
        accept = accept_length(
            cand_conf.gather(1, order), self.tau, self.metric, (self.block_end - self.filled).clamp(min=1)
        )
        accept = torch.where(filling, accept, 0)
        is_stop = torch.isin(cand.gather(1, order), self.stop_ids) & (cols < accept[:, None])
        stopped = is_stop.any(dim=1)
        accept = torch.where(stopped, is_stop.long().argmax(dim=1) + 1, accept)
        write = (cols >= self.filled[:, None]) & (cols < (self.filled + accept)[:, None])
        self.block = torch.where(write, cand, self.block)
        self.placed &= ~write
        new = cand.gather(1, order)
        for row, n in enumerate(accept.tolist()):  # host bookkeeping: once per row per step
            if n:
                self.ids[row] += new[row, :n].tolist()
                self.accept_log[row].append(n)
                if not self.reported[row]:
                    self._last[self.request_ids[row]] = new[row, :n].tolist()
        self.filled = torch.where(stopped, self.block_end, self.filled + accept)  # a stopped row sits out
        done = self._end(stopped.nonzero().flatten().tolist())
        return done + self._close_block()

    def _close_block(self) -> list[FinishedRow]:
        """Once no row fills the block any more: count its positions, and end the rows it took to
        their ``max_new_tokens``."""
        if not self.request_ids or self.closed or bool((self.filled < self.block_end).any()):
            return []
        self.closed = True
        self.generated += int(self.block_end.max())
        return self._end((self.generated >= self.max_new).nonzero().flatten().tolist())

    def _commit(self) -> None:
        """The blocks into the cache; the output after each is its row's AR token for the next."""
        logits = self._forward(commit=True)
        self.held = confidence(logits[:, -1:], self.metric)[0][:, 0]
        rows = len(self.request_ids)
        self.slot_valid = torch.cat(
            [self.slot_valid, torch.ones(rows, self.size, dtype=torch.bool, device=self.device)], 1
        )
        self.committed = self.committed + self.size

    def _forward(self, commit: bool) -> torch.Tensor:
        """The blocks at their rows' positions, causal among themselves, masks where ``placed``
        says; the cache keeps them only on commit."""
        rows, size = self.block.shape
        positions = self.committed[:, None] + torch.arange(size, device=self.device)
        fed_valid = torch.ones(rows, size, dtype=torch.bool, device=self.device)
        with placed_masks(self.model, self.placed):
            mask = self._mask(self.slot_valid, fed_valid)
            logits = self._call(self.block, positions, mask, logits_to_keep=1 if commit else 0)
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

    # ------------------------------------------------------------------ rows ending
    def _end(self, rows: list[int]) -> list[FinishedRow]:
        """Report ``rows`` once each; they sit out the batch's remaining steps, and the batch
        empties when its last row is reported."""
        done = []
        for i in rows:
            if self.reported[i]:
                continue
            self.reported[i] = True
            self.finished[i] = True
            if self.kv is not None:
                self.filled[i] = self.block_end[i]
            self._last.pop(self.request_ids[i], None)
            done.append(self._finished_row(i))
        if self.request_ids and all(self.reported):
            self._reset()
        return done

    def _finished_row(self, i: int) -> FinishedRow:
        """Row ``i``'s answer: its tokens up to a stop token, which ends it as stopped."""
        stop = set(self.stop_ids.tolist())
        ids = self.ids[i]
        end = next((k for k, t in enumerate(ids) if t in stop), None)
        if end is not None:
            return FinishedRow(self.request_ids[i], ids[:end], True, self.accept_log[i])
        return FinishedRow(self.request_ids[i], ids, False, self.accept_log[i])
