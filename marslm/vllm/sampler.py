"""The acceptance step inside vLLM: vLLM's rejection sampler, taught what a mask draft is.

A step of a MARS row feeds ``[last token | drafts]`` where the drafts end with mask tokens:

    threshold   [x | M M M M]            candidates: the AR token at x, then each mask's prediction
    lossless    [x | d1 d2 M M M M]      d = the last step's mask predictions, verified as usual

Every row goes through vLLM's own rejection sampler first, with the masks hidden (a mask is a
placeholder, never a token of the answer, so it is always rejected and its KV rolls back). Then:

  * threshold rows take [AR token, mask predictions] instead, as many as acceptance.py accepts
    (the scheduler re-feeds the accepted mask positions as real tokens, scheduler.py);
  * lossless rows keep vLLM's verified output, and when every real draft was accepted, the
    masks' predictions become the next step's drafts (proposer.py reads them).

All of it is tensor work over ``[rows, positions]`` with each row's tau and metric, so requests
with different settings share a batch, and nothing here waits for the device.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

from ..decode.acceptance import accept_length, confidence
from .request_settings import LOSSLESS, OFF, THRESHOLD, PluginConfig, request_settings

log = logging.getLogger("marslm.vllm")


class MarsRows:
    """Each row's MARS settings for the model runner's current batch, rebuilt when the batch changes.

    Settings come from the requests' ``SamplingParams`` that the runner keeps; the row order is
    the runner's input batch, which is also the order of the sampler's and the proposer's rows.
    """

    def __init__(self, runner, config: PluginConfig):
        self.runner = runner
        self.config = config
        self.device = runner.device
        self._key: tuple | None = None
        self.mode = np.zeros(0, dtype=np.int8)
        self.tau = torch.zeros(0, dtype=torch.float64)
        self.metric = torch.zeros(0, dtype=torch.long)
        self.metrics_present: set[int] = set()
        self.is_threshold = torch.zeros(0, dtype=torch.bool)
        self.is_lossless = torch.zeros(0, dtype=torch.bool)
        # lossless: the masks' predictions of the last sampler call, for the proposer
        self.next_drafts: tuple[torch.Tensor, torch.Tensor] | None = None

    def refresh(self) -> MarsRows:
        batch = self.runner.input_batch
        req_ids = tuple(batch.req_ids[: batch.num_reqs])
        if req_ids == self._key:
            return self
        # once per change of the batch, not per step
        settings = [request_settings(self.runner.requests[req_id].sampling_params, self.config) for req_id in req_ids]
        self.mode = np.array([s.mode for s in settings], dtype=np.int8)
        to = {"device": self.device, "non_blocking": True}
        self.tau = torch.tensor([s.tau for s in settings], dtype=torch.float64).to(**to)
        self.metric = torch.tensor([s.metric for s in settings], dtype=torch.long).to(**to)
        self.metrics_present = {s.metric for s in settings}
        self.is_threshold = torch.from_numpy(self.mode == THRESHOLD).to(**to)
        self.is_lossless = torch.from_numpy(self.mode == LOSSLESS).to(**to)
        self._key = req_ids
        return self

    @property
    def any_mars(self) -> bool:
        return bool((self.mode != OFF).any())

    def take_next_drafts(self):
        drafts, self.next_drafts = self.next_drafts, None
        return drafts


class MarsRejectionSampler(RejectionSampler):
    def __init__(self, *args, rows: MarsRows, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = rows
        self.mask_token_id = rows.config.mask_token_id

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        rows = self.rows.refresh()
        if not rows.any_mars:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        dev = logits.device
        n_rows = len(metadata.num_draft_tokens)
        width = metadata.max_spec_len + 1  # positions: the last token, then the drafts

        # --- each row's drafts and logits as [rows, positions]
        n_drafts = torch.diff(metadata.cu_num_draft_tokens.long(), prepend=torch.zeros(1, dtype=torch.long, device=dev))
        pos = torch.arange(width, device=dev)
        draft_at = (metadata.cu_num_draft_tokens.long() - n_drafts)[:, None] + pos[None, :-1]
        draft_valid = pos[None, :-1] < n_drafts[:, None]
        drafts = metadata.draft_token_ids.long()[draft_at.clamp(0, max(len(metadata.draft_token_ids) - 1, 0))]
        is_mask = draft_valid & (drafts == self.mask_token_id)
        logit_at = (metadata.cu_num_sampled_tokens.long() - n_drafts - 1)[:, None] + pos
        logit_at = logit_at.clamp(0, logits.shape[0] - 1)
        predicted = logits.argmax(dim=-1)[logit_at]  # [rows, positions]; read before vLLM's
        # sampler may reuse `logits`
        threshold_out = None
        if bool((rows.mode == THRESHOLD).any()):
            threshold_out = self._threshold(logits[logit_at], predicted, is_mask, rows, n_rows)

        # --- vLLM's verification, masks hidden: a placeholder never matches the target's argmax
        hidden = metadata.draft_token_ids.masked_fill(
            metadata.draft_token_ids == self.mask_token_id, PLACEHOLDER_TOKEN_ID
        )
        out = super().forward(replace(metadata, draft_token_ids=hidden), draft_probs, logits, sampling_metadata)
        tokens = out.sampled_token_ids

        if bool((rows.mode == LOSSLESS).any()):
            self._record_lossless(tokens, predicted, draft_valid, is_mask, rows)
        if threshold_out is not None:
            tokens = torch.where(rows.is_threshold[:n_rows, None], threshold_out.to(tokens.dtype), tokens)
            out = replace(out, sampled_token_ids=tokens)
        return out

    def _threshold(self, row_logits, predicted, is_mask, rows, n_rows):
        """[AR token, mask predictions]: the leading ones that acceptance.py accepts, then placeholders."""
        _, conf = confidence(row_logits, rows.metric[:n_rows], present=rows.metrics_present)
        leading_masks = is_mask.long().cumprod(dim=1).sum(dim=1)
        accept = accept_length(conf, rows.tau[:n_rows], rows.metric[:n_rows], max_accept=leading_masks + 1)
        keep = torch.arange(predicted.shape[1], device=predicted.device)[None, :] < accept[:, None]
        return predicted.masked_fill(~keep, PLACEHOLDER_TOKEN_ID)

    def _record_lossless(self, tokens, predicted, draft_valid, is_mask, rows):
        """The masks' predictions, valid as next drafts only where every real draft was accepted."""
        n_real = (draft_valid & ~is_mask).long().cumprod(dim=1).sum(dim=1)
        n_masks = is_mask.long().sum(dim=1)
        emitted = (tokens != PLACEHOLDER_TOKEN_ID).long().sum(dim=1)
        width = max(self.rows.config.num_masks, 1)
        at = (n_real + 1)[:, None] + torch.arange(width, device=tokens.device)[None, :]
        next_drafts = predicted.gather(1, at.clamp(max=predicted.shape[1] - 1))
        usable = rows.is_lossless[: len(tokens)] & (emitted == n_real + 1) & (n_masks > 0)
        self.rows.next_drafts = (next_drafts, torch.where(usable, n_masks.clamp(max=width), 0))
