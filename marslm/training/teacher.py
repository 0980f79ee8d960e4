"""The original model's next-token distributions over the training answers, kept as top-k.

Hard labels on a model's own greedy answers do not leave it where it was: cross-entropy keeps
raising the label's probability, which sharpens the distribution and, across the shared weights,
flips near-ties on answers it never saw. A target that is the original's own distribution does
not: the model it was taken from gets no gradient from it (head_loss.SparseTargets), so the only
pull on the clean stream is back toward the original. That is the anchor ``marslm train
--soft-clean`` uses, and ``--soft-masked`` gives the masks the same distribution beside their
hard labels.

One teacher-forced pass of the model training starts from, before the first step, over the
examples as training encodes them: the top-k of the output at t-1 is kept for every labelled t,
aligned with the labels, so the collators carry it through padding, packing and the two streams
(objective.TEACHER_KEYS).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..chat import IGNORE
from .head_loss import logits_at

# Logit elements computed at once: 2^27 float32 logits are 512 MiB.
LOGITS_BUDGET = 2**27


def _groups(examples: list[dict], vocab_size: int) -> list[list[int]]:
    """Example indices, shortest first, in groups whose kept logits fit the budget."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    groups, group, width = [], [], 0
    for i in order:
        width_if_added = max(width, len(examples[i]["input_ids"]))
        if group and (len(group) + 1) * width_if_added * vocab_size > LOGITS_BUDGET:
            groups.append(group)
            group, width_if_added = [], len(examples[i]["input_ids"])
        group.append(i)
        width = width_if_added
    return groups + [group] if group else groups


def top_k_rows(logits: torch.Tensor, scored: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, probs)``, ``[rows, T, k]`` int32 and float32: the top-k of ``logits`` (the outputs at the
    ``scored [rows, T]`` columns, in row-major order), each on the label its output predicts (the
    next column); zeros elsewhere."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k)
    ids = torch.zeros((*scored.shape, k), dtype=torch.int32, device=logits.device)
    probs = torch.zeros((*scored.shape, k), dtype=torch.float32, device=logits.device)
    target = scored.roll(1, dims=1)
    ids[target], probs[target] = top.indices.to(torch.int32), top.values.exp()
    return ids, probs


@torch.no_grad()
def teacher_top_k(model, examples: list[dict], k: int, pad_id: int, progress: bool = False) -> list[dict]:
    """Per example, ``teacher_ids [T, k]`` (int32) and ``teacher_probs [T, k]`` (float32): at each
    position t whose label is trained, the model's k most likely tokens for position t given the
    tokens before it, and their probabilities; zeros at the other positions."""
    from .collate import collate

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[dict] = [{} for _ in examples]
    groups = _groups(examples, model.get_output_embeddings().weight.shape[0])
    for group in tqdm(groups, desc="teacher top-k", unit="batch", disable=not progress):
        batch = collate([examples[i] for i in group], pad_id)
        input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        scored = torch.zeros_like(labels, dtype=torch.bool)
        scored[:, :-1] = labels[:, 1:] != IGNORE  # the output at t-1 predicts the label at t
        ids, probs = top_k_rows(logits_at(model, scored, input_ids=input_ids), scored, k)
        for row, i in enumerate(group):
            length = len(examples[i]["input_ids"])
            out[i] = {"teacher_ids": ids[row, :length].cpu(), "teacher_probs": probs[row, :length].cpu()}
    model.train(was_training)
    return out
