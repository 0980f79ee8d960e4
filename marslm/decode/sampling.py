"""Sampling at temperature > 0, and the speculative-sampling rule that keeps lossless mode exact.

Lossless decoding feeds the masks' predictions of one step as drafts in the next. Greedy, a draft
is kept when it equals the AR argmax. Sampling, each draft is drawn from its mask's distribution q
and the next forward's AR distribution p decides (Leviathan et al. 2023; Chen et al. 2023):

    keep draft d with probability min(1, p(d) / q(d))
    at the first draft not kept, draw from the residual  max(0, p - q) / sum(max(0, p - q))
    if every draft was kept, draw the next token from p

so every emitted token is distributed exactly as sampling the AR model alone. p and q go through
the same temperature, top-k and top-p (:func:`sampling_probs`); the rule holds for any q.
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


def speculative_accept(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many drafts each row keeps, and the distribution to draw the token after them from.

    p ``[rows, K + 1, vocab]``: the AR distributions at the last real token and at each draft;
    q ``[rows, K, vocab]``: the distributions the drafts were drawn from; draft ``[rows, K]``;
    draft_len ``[rows]`` (drafts past it are padding); uniform ``[rows, K]`` in [0, 1).
    """
    rows, k = draft.shape
    p_draft = p[:, :k].gather(-1, draft[..., None])[..., 0]
    q_draft = q.gather(-1, draft[..., None])[..., 0]
    keep = uniform * q_draft < p_draft  # u < p/q, without dividing by q
    keep &= torch.arange(k, device=draft.device) < draft_len[:, None]
    kept = keep.long().cumprod(dim=1).sum(dim=1)
    at = kept[:, None, None].expand(-1, 1, p.shape[-1])
    p_next = p.gather(1, at)[:, 0]
    rejected = kept < draft_len
    q_next = q.gather(1, at.clamp(max=max(k - 1, 0)))[:, 0] if k else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # a residual with no mass can only come from p == q, where any draw from p is right
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    return kept, torch.where(rejected[:, None], residual, p_next)
