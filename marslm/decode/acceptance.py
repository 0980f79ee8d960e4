"""The acceptance rule, in one place: how many of a step's candidate tokens to keep.

Candidates come left to right: the AR prediction at the last real token, then the predictions at
the appended masks. Greedy argmax gives the tokens; a confidence score per candidate decides how
far to go. The first candidate is the AR token and is always accepted, whatever its confidence
(it is what plain AR decoding would emit, so decoding always makes progress); the mask candidates
after it are accepted left to right while their confidence passes tau. This is the reference
sampler's rule (Xalp/MARS, ``left_to_right_step``).

    prob     top-1 probability          accept while p >= tau      tau in (0, 1]
    margin   top-1 minus top-2 prob     accept while m >= tau      tau in (0, 1]
    entropy  entropy of the softmax     accept while H <= tau      tau >= 0

One-token mode (prob/margin with tau >= 1, entropy with tau <= 0) accepts exactly one token,
whatever the float rounding: an fp32 softmax can round a confident prediction to exactly 1.0,
and one-token mode must equal greedy AR decoding token for token.

Everything is an array operation over ``[batch, candidates]``, with tau and the metric per row,
so requests with different settings share one batch. The rule takes torch tensors (the vLLM
plugin, on the device) or numpy arrays (the decoding loop's host-side bookkeeping) alike.
"""

from __future__ import annotations

import numpy as np
import torch

from .params import ENTROPY, MARGIN, one_token_rows


def confidence(
    logits: torch.Tensor, metric: torch.Tensor, present: set[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and their confidence under each row's metric.

    logits: ``[batch, candidates, vocab]``; metric: ``[batch]`` metric codes. ``present``: the
    codes in ``metric``, when the caller knows them without asking the device (which waits).
    Returns ``(tokens, conf)``, both ``[batch, candidates]``.
    """
    probs = logits.float().softmax(dim=-1)
    margin = MARGIN in present if present is not None else bool((metric == MARGIN).any())
    if margin:
        top2 = probs.topk(2, dim=-1)
        tokens, conf = top2.indices[..., 0], top2.values[..., 0]
        conf = torch.where(metric[:, None] == MARGIN, conf - top2.values[..., 1], conf)
    else:
        conf, tokens = probs.max(dim=-1)
    if ENTROPY in present if present is not None else (metric == ENTROPY).any():
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
        conf = torch.where(metric[:, None] == ENTROPY, entropy, conf)
    return tokens, conf


def accept_length(
    conf: torch.Tensor, tau: torch.Tensor, metric: torch.Tensor, max_accept: torch.Tensor | None = None
) -> torch.Tensor:
    """Number of leading candidates to accept per row, in ``1..candidates``.

    conf: ``[batch, candidates]``; tau, metric: ``[batch]``; max_accept: optional ``[batch]`` cap
    (a request may use a smaller block than the batch was run with).
    """
    xp = _namespace(conf)
    # tau in the confidence's precision: a float32 confidence that rounds to exactly tau passes
    tau_col = tau[:, None].astype(conf.dtype) if xp is np else tau[:, None].to(conf.dtype)
    passes = xp.where(metric[:, None] == ENTROPY, conf <= tau_col, conf >= tau_col)
    passes[:, 0] = True  # the AR token: accepted whatever its confidence
    accept = xp.cumprod(passes * 1, -1).sum(-1)
    accept = xp.where(one_token_rows(tau, metric), 1, accept)
    if max_accept is not None:
        accept = xp.minimum(accept, max_accept)
    return accept


def _namespace(array):
    return torch if isinstance(array, torch.Tensor) else np
