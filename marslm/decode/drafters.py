"""The separate draft models of draft_model.py: an AR drafter, and a MARS drafter that also reads
its own masks.

Both keep their own KV cache over the text they have read and roll it back to the longest prefix
it shares with the text when the target rejects drafts. A drafter forward feeds the tokens not yet
cached (the text's, or the drafts of its previous forward) and, for a MARS drafter, its block's
masks after them, then keeps only the fed tokens' keys and values: masks are never cached. The
output at the last fed token is a draft; a MARS drafter adds its masks' predictions after it, left
to right while confident under its own tau (acceptance.py's rule, as the target's threshold mode
applies it), so one forward can draft several tokens. Sampling, every draft is the race winner of
the distribution of the output it came from, raced at its position with the noise the target
races that position with (draws.py): the target's output is its own sample whatever is drafted.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..adapter import placed_masks
from .acceptance import accept_length, confidence
from .params import DRAFT_METRIC, DecodingParams, metric_code, one_token
from .sampling import sampling_probs


class ARDrafter:
    """An HF causal LM proposing one token per forward from its own KV cache."""

    n_masks, mask_token_id = 0, None  # the masks fed after the pending tokens (a MARS drafter's)

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.cache, self.cached = DynamicCache(), []  # the ids whose keys/values the cache holds

    def rollback(self, ids: list[int]) -> None:
        """Keep only the cached tokens that are a prefix of ``ids``."""
        keep = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            keep += 1
        if keep < len(self.cached):
            crop_to(self.cache, keep)
            self.cached = self.cached[:keep]

    @torch.no_grad()
    def propose(self, ids: list[int], k: int, params: DecodingParams, race) -> list[int]:
        """``k`` drafts after ``ids``; sampling, each drawn by ``race(probs, positions)`` at its position."""
        self.rollback(ids)
        if len(self.cached) == len(ids):  # the last token must be fed to read its output
            self.rollback(ids[:-1])
        drafts, feed = [], ids[len(self.cached) :]
        while len(drafts) < k:
            logits = self._forward(feed)
            n = min(self._accepted(logits), k - len(drafts))
            feed = draw(logits[:n], params, race, len(ids) + len(drafts), self.device)
            drafts += feed
        return drafts

    def _accepted(self, logits: torch.Tensor) -> int:
        """How many of a forward's outputs become drafts: the AR output's alone."""
        return 1

    def _forward(self, feed: list[int]) -> torch.Tensor:
        """Logits at the last fed token and at each mask after it; only ``feed`` stays cached.
        Plain causal attention, the model's own mask: the masks come last and see all before them."""
        start, fed = len(self.cached), feed + [self.mask_token_id] * self.n_masks
        ids = torch.tensor([fed], device=self.device)
        positions = torch.arange(start, start + len(fed), device=self.device)[None]
        with placed_masks(self.model, [[False] * len(feed) + [True] * self.n_masks]):
            out = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True)
        self.forwards += 1
        self.cached += feed
        crop_to(self.cache, len(self.cached))  # the masks' keys/values
        return out.logits[0, len(feed) - 1 :]


class MarsDrafter(ARDrafter):
    """A MARS checkpoint drafting the AR output, then its masks' predictions while they pass its own
    ``tau`` (top-1 probability): several tokens per forward where it is confident. At tau 1 it reads
    no masks and drafts as an AR drafter does."""

    def __init__(self, model, mask_token_id: int, tau: float, n_masks: int):
        super().__init__(model)
        self.mask_token_id, self.tau = mask_token_id, tau
        self.n_masks = 0 if one_token(tau, DRAFT_METRIC) else n_masks

    def _accepted(self, logits: torch.Tensor) -> int:
        return 1 + len(confident_masks(logits[1:], self.tau, DRAFT_METRIC))


def confident_masks(mask_logits: torch.Tensor, tau: float, metric: str) -> list[int]:
    """The greedy predictions of the masks ``[n, vocab]`` after an accepted token, accepted left to
    right while they pass tau: acceptance.py's rule, whose always-accepted first candidate is that
    token."""
    code = torch.tensor([metric_code(metric)])
    predicted, conf = confidence(mask_logits[None].cpu(), code)
    conf = torch.cat([torch.zeros(1, 1), conf], dim=1)
    return predicted[0, : int(accept_length(conf, torch.tensor([tau]), code)[0]) - 1].tolist()


def draw(logits: torch.Tensor, params: DecodingParams, race, position: int, device) -> list[int]:
    """One draft per row of ``logits`` ``[n, vocab]``, for the positions from ``position`` on: the
    argmax, or sampling the race winner of each row's distribution (``race(probs, positions)``)."""
    if params.temperature <= 0:
        return logits.argmax(-1).tolist()
    return race(probs(logits, params, device), range(position, position + len(logits))).tolist()


def probs(logits: torch.Tensor, params: DecodingParams, device) -> torch.Tensor:
    """``sampling_probs`` for one row's ``[n, vocab]`` logits."""
    t, p, k = (torch.tensor([v], device=device) for v in (params.temperature, params.top_p, params.top_k))
    return sampling_probs(logits[None], t, p, k)[0]


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` tokens' keys/values (``crop`` takes how many to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
