"""Exact mode's objective: the base model frozen, an adapter at mask positions (adapter.py).

Under MARS's attention mask clean positions never read mask positions, so the clean stream is the
frozen model's own forward: it has nothing to learn, and its keys and values serve as the cache
the masked stream reads. The loss is the masked term of objective.py's, computed on top of it.
"""

from __future__ import annotations

import torch

from ..adapter import adapter_of
from ..chat import IGNORE
from ..masks import training_mask
from .objective import (
    LossOptions,
    TwoStreamBatch,
    copied_columns,
    loss_at,
    masked_targets,
    target_weights,
    two_stream_batch,
)
from .teacher import top_k_rows


def exact_mars_loss(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    options: LossOptions,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | None = None,
) -> dict[str, torch.Tensor]:
    """The masked stream's loss for a frozen model whose masks carry an adapter (adapter.py).

    The clean stream has nothing to learn, so it runs once without autograd and leaves its keys
    and values as the cache the masked stream reads: the backward pass, and the activations it
    keeps, cover the masked stream alone. The clean stream's distribution at each target is the
    frozen model's own, a teacher for the masks at no extra cost (``soft_masked``, top
    ``teacher_top_k``). Arguments as in :func:`mars_loss`; ``ar_weight`` and ``soft_clean`` do not apply.
    """
    o = options
    phases = o.masking.phases(segment_ids, len(input_ids), o.block_size)
    batch = two_stream_batch(input_ids, labels, o.block_size, o.mask_token_id, position_ids, segment_ids, phases)
    width = input_ids.shape[1]
    cache, teacher = clean_pass(model, batch, o.teacher_top_k if o.soft_masked else 0)
    noisy_teacher = None if teacher is None else tuple(copied_columns(t, batch.noisy_columns) for t in teacher)

    weights = target_weights(labels, segment_ids, o.normalization)
    if denominator is None:
        denominator = max(1.0, float(weights.sum()))
    rows, columns, targets, noisy_w = masked_targets(
        batch, weights, segment_ids, o.masked_weighting, noisy_teacher, o.soft_masked, o.masking
    )
    inputs = {
        "input_ids": batch.input_ids[:, width:],
        "position_ids": batch.position_ids[:, width:],
        "attention_mask": batch.mask_for(model, first_query=width),
        "cache": cache,
        "use_cache": True,
    }
    with adapter_of(model).gate(batch.placed_masks[:, width:], offsets=batch.mask_offsets()):
        loss, ce = loss_at(model, inputs, rows, columns, targets, noisy_w / denominator, o.target_logits)
    noisy_loss = (ce * noisy_w).sum() / denominator
    return {"loss": loss, "noisy_loss": noisy_loss.detach()}


@torch.no_grad()
def clean_pass(model, batch: TwoStreamBatch, top_k: int = 0):
    """``(cache, teacher)``: the clean stream's keys and values, and with ``top_k`` the model's top-k
    next-token distribution at every target (``[rows, T, k]`` ids and probabilities, on the label
    each output predicts, as teacher.py keeps them; None without)."""
    width = batch.labels.shape[1]
    inputs = {
        "input_ids": batch.input_ids[:, :width],
        "position_ids": batch.position_ids[:, :width],
        "attention_mask": training_mask(
            batch.position_ids[:, :width], batch.segment_ids[:, :width], batch.streams[:, :width], 1, model
        ),
        "use_cache": True,
    }
    if not top_k:
        return model(**inputs, logits_to_keep=1).past_key_values, None
    scored = torch.zeros_like(batch.labels, dtype=torch.bool)
    scored[:, :-1] = batch.labels[:, 1:] != IGNORE
    out = model(**inputs, logits_to_keep=scored)
    return out.past_key_values, top_k_rows(out.logits.reshape(-1, out.logits.shape[-1]), scored, top_k)
