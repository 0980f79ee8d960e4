"""Sampling at temperature > 0: the probabilities a row samples from, per read column.

Temperature, top-k and top-p apply as transformers applies them. The draw itself is draws.py's
(an exponential race keyed by position), which is also what keeps lossless mode exact: a draft
and the AR token at its position race with the same noise, and a draft is kept where it won.
"""

from __future__ import annotations

import torch


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, per row: logits ``[rows, n, vocab]``, the
    settings ``[rows]``. Rows at temperature 0 get their softmax at temperature 1 (never sampled)."""
    t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)[:, None, None]
    scores = logits.float() / t
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k < vocab).any()) or bool((top_p < 1).any()):
        ordered, order = scores.sort(dim=-1, descending=True)
        ordered = ordered.masked_fill(torch.arange(vocab, device=scores.device) >= k[:, None, None], float("-inf"))
        # then top-p, as transformers orders them: the smallest prefix of the top-k whose mass reaches p
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p.to(torch.float32)[:, None, None]) & (top_p < 1)[:, None, None]
        drop[..., 0] = False
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return scores.softmax(dim=-1)
