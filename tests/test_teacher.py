"""The teacher's top-k (teacher.py) and the soft targets built from it (objective.py)."""

from __future__ import annotations

import pytest
import torch

from marslm.training.collate import collate, collate_packed
from marslm.training.teacher import teacher_top_k
from tests.helpers import assert_same_loss_and_grads, stage_loss_and_grads
from tests.test_head_loss import EOS_ID, PAD_ID, _examples


def _with_teacher(model, examples, k):
    return [ex | top for ex, top in zip(examples, teacher_top_k(model, examples, k, PAD_ID))]


def test_teacher_top_k_is_the_models_next_token_distribution_at_each_label(tiny_tokenizer, make_tiny_model):
    model = make_tiny_model(seed=3)
    examples = _examples(tiny_tokenizer, 5)
    tops = teacher_top_k(model, examples, 4, PAD_ID)
    for ex, top in zip(examples, tops):
        ids = torch.tensor([ex["input_ids"]])
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        for t, label in enumerate(ex["labels"]):
            if t == 0 or label < 0:
                assert not top["teacher_probs"][t].any()
                continue
            want = probs[t - 1].topk(4)
            assert top["teacher_ids"][t].tolist() == want.indices.tolist()
            torch.testing.assert_close(top["teacher_probs"][t], want.values, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_the_model_the_teacher_was_taken_from_gets_no_gradient_from_the_anchor(tiny_tokenizer, make_tiny_model, packed):
    """soft_clean = 1 is a KL to the teacher: zero at the teacher, whatever k, through padding and
    packing. A top-k misaligned by one position, or a target that sharpens, would pull."""
    model = make_tiny_model(seed=5).train()
    examples = _with_teacher(model, _examples(tiny_tokenizer, 6), k=3)
    batch = (collate_packed if packed else collate)(examples, pad_id=PAD_ID)
    terms, grads = stage_loss_and_grads(model, batch, "ar", soft_clean=1.0)
    assert max(g.abs().max() for g in grads.values()) < 1e-5
    _, hard_grads = stage_loss_and_grads(make_tiny_model(seed=5).train(), batch, "ar")
    assert max(g.abs().max() for g in hard_grads.values()) > 1e-3


@pytest.mark.parametrize("packed", [False, True])
def test_soft_targets_give_the_full_logits_loss_and_gradients(tiny_tokenizer, make_tiny_model, packed):
    teacher = make_tiny_model(seed=6)
    examples = _with_teacher(teacher, _examples(tiny_tokenizer, 6), k=5)
    collate_fn = collate_packed if packed else collate
    batch = collate_fn(examples, pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    assert batch["teacher_probs"].shape[:2] == batch["labels"].shape

    def run(target_logits):
        model = make_tiny_model(seed=7).train()
        return stage_loss_and_grads(
            model, batch, "mars", soft_clean=0.6, soft_masked=0.3, ar_weight=0.5, target_logits=target_logits
        )

    assert_same_loss_and_grads(run(True), run(False), loss_atol=1e-6)


def test_the_masked_streams_soft_targets_are_the_teachers_at_the_copied_column(tiny_tokenizer, make_tiny_model):
    """With every target soft (share 1) and the teacher given as the noisy stream's only target,
    the masked loss equals a CE against the teacher rows of the positions each mask stands for."""
    from marslm.training.head_loss import SparseTargets, cross_entropy
    from marslm.training.objective import LossOptions, mars_loss, two_stream_batch

    teacher = make_tiny_model(seed=8)
    examples = _with_teacher(teacher, _examples(tiny_tokenizer, 3), k=4)
    batch = collate(examples, pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    model = make_tiny_model(seed=9)
    teacher_rows = {k: batch[k] for k in ("teacher_ids", "teacher_probs")}
    with torch.no_grad():
        terms = mars_loss(
            model,
            batch["input_ids"],
            batch["labels"],
            LossOptions(4, 3, normalization="token", soft_masked=1.0),
            **teacher_rows,
        )
    two = two_stream_batch(batch["input_ids"], batch["labels"], 4, 3)
    logits = model(
        input_ids=two.input_ids, position_ids=two.position_ids, attention_mask=two.attention_mask
    ).logits.detach()
    width = batch["input_ids"].shape[1]
    losses = []
    for r, c in (two.noisy_labels[:, 1:] >= 0).nonzero().tolist():
        p = int(two.noisy_columns[r, c + 1])  # the clean position the target at noisy column c + 1 copies
        ids, probs = batch["teacher_ids"][r, p].long(), batch["teacher_probs"][r, p]
        if probs.sum() == 0:  # block padding past the answer: its label is the target
            target = torch.tensor([int(batch["labels"][r, p])])
        else:
            target = SparseTargets(ids[None], probs[None])
        losses.append(cross_entropy(logits[r, width + c][None], target))
    torch.testing.assert_close(terms["noisy_loss"], torch.cat(losses).mean(), rtol=1e-5, atol=1e-6)
