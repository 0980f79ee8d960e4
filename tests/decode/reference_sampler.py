"""A reference MARS sampler for tests, written plainly and independently of ``marslm.decode``.

No KV cache, no batching, no tensor tricks: one row at a time, a Python loop per step, the whole
sequence re-fed every forward, the acceptance rule spelled out as the authors' sampler states it
(Xalp/MARS ``left_to_right_step``): the first candidate (the AR prediction) is always accepted,
each later candidate while its confidence passes tau. It exists to catch bugs that the decoder's
own cache modes would share (mask positions, candidate alignment, the rule itself).

Two windows:

    sliding   every step appends ``block_size`` masks after the last accepted token; candidates are
              the output at the last real token (AR) and at the first ``block_size - 1`` masks
              (``last_mask``: at all ``block_size`` masks, marslm's default);
              ``adaptive``: marslm's adaptive width restated: after the second step running that
              accepted none of the masks it read, and after each further one, read no masks for
              1, 2, 4, 8, at most 16 steps
    block     the paper's block-level cache (section 4.5): generation is cut into blocks of
              ``block_cache_size`` positions; each step feeds the block so far (accepted tokens, then
              masks up to the block's end) and accepts from its first unfilled position on; a
              full block is committed and the next one starts
"""

from __future__ import annotations

import math

import torch


def _confidence(logits_row: torch.Tensor, metric: str) -> tuple[int, float]:
    probs = torch.softmax(logits_row.double(), dim=-1)
    top = torch.topk(probs, 2)
    token = int(top.indices[0])
    if metric == "prob":
        return token, float(top.values[0])
    if metric == "margin":
        return token, float(top.values[0] - top.values[1])
    if metric == "entropy":
        return token, -sum(float(p) * math.log(float(p)) for p in probs.tolist() if p > 0)
    raise ValueError(metric)


def _passes(conf: float, tau: float, metric: str) -> bool:
    return conf <= tau if metric == "entropy" else conf >= tau


def _one_token_mode(tau: float, metric: str) -> bool:
    return tau <= 0 if metric == "entropy" else tau >= 1


def _accept(candidates: list[tuple[int, float]], tau: float, metric: str) -> list[int]:
    accepted = [candidates[0][0]]
    if _one_token_mode(tau, metric):
        return accepted
    for token, conf in candidates[1:]:
        if not _passes(conf, tau, metric):
            break
        accepted.append(token)
    return accepted


@torch.no_grad()
def _logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0]


@torch.no_grad()
def reference_generate(
    model,
    prompt: list[int],
    *,
    mask_id: int,
    stop_ids: set[int],
    tau: float,
    metric: str,
    block_size: int,
    max_new_tokens: int,
    window: str = "sliding",
    block_cache_size: int = 16,
    adaptive: bool = False,
    last_mask: bool = False,
) -> tuple[list[int], list[int]]:
    """``(new tokens without the stop token, tokens accepted per forward)`` for one prompt."""
    generated: list[int] = []
    steps: list[int] = []
    misses = pause = 0
    while True:
        seq = prompt + generated
        if window == "sliding":
            logits = _logits(model, seq + [mask_id] * block_size)
            # output i predicts position i + 1: the last real token's output, then the masks'
            reads = 0 if adaptive and pause else block_size - 1 + last_mask
            candidates = [_confidence(logits[len(seq) - 1 + k], metric) for k in range(reads + 1)]
        else:
            filled = len(generated) % block_cache_size
            masks = block_cache_size - filled
            logits = _logits(model, seq + [mask_id] * masks)
            candidates = [_confidence(logits[len(seq) - 1 + k], metric) for k in range(masks)]
        accepted = _accept(candidates, tau, metric)[: max_new_tokens - len(generated)]
        for i, token in enumerate(accepted):
            if token in stop_ids:
                accepted = accepted[: i + 1]
                break
        generated += accepted
        steps.append(len(accepted))
        if adaptive and not _one_token_mode(tau, metric):
            used = len(accepted) - 1
            if reads:
                misses = misses + 1 if used == 0 else 0
                pause = min(2 ** (misses - 2), 16) if misses >= 2 else 0
            else:
                pause -= 1
        if accepted[-1] in stop_ids:
            return generated[:-1], steps
        if len(generated) >= max_new_tokens:
            return generated, steps
