"""Exact mode's objective (exact.exact_mars_loss) and the data-efficient masking options."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from marslm.adapter import MaskAdapter, mask_offsets
from marslm.training.collate import collate, collate_packed
from marslm.training.exact import clean_pass, exact_mars_loss
from marslm.training.objective import LossOptions, Masking, mars_loss, two_stream_batch
from tests.helpers import chat_conversations


def _examples(tokenizer, n=6, seed=0):
    from marslm.chat import encode_conversation

    out = []
    for messages in chat_conversations(n, seed):
        encoded = encode_conversation(tokenizer, messages)
        out.append({"input_ids": encoded.input_ids, "labels": encoded.labels})
    return out


@pytest.fixture
def setup(make_tiny_model, tiny_tokenizer):
    model = make_tiny_model()
    model.requires_grad_(False)
    mask_id = model.get_input_embeddings().weight.shape[0]
    adapter = MaskAdapter.for_model(model, mask_id, rank=4, rows=4)
    with torch.no_grad():  # as if trained: a fresh adapter changes nothing
        for p in adapter.lora.parameters():
            p.normal_(0, 0.3)
        adapter.rows.normal_(0, 1.0)
    examples = _examples(tiny_tokenizer)
    return model, adapter, mask_id, examples, tiny_tokenizer


def _grads(adapter):
    return [p.grad.clone() for p in adapter.parameters()]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("masking", [Masking(), Masking(random_phase=True, streams=3, offset_decay=0.7)])
def test_exact_loss_is_the_masked_term_of_one_two_stream_forward(setup, packed, masking):
    """The clean stream as a cache the masks read gives the loss and adapter gradients of the
    paper's single two-stream forward (its clean term off). The two forwards also find each mask's
    offset in two ways: counted over the batch (exact) and read off the dense mask (adapter)."""
    model, adapter, mask_id, examples, tok = setup
    adapter.attach(model)
    pad = tok.pad_token_id
    batch = (
        collate_packed(examples, pad, 4, tok.eos_token_id) if packed else collate(examples, pad, 4, tok.eos_token_id)
    )
    extra = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
    results = []
    for loss_fn, kwargs in ((exact_mars_loss, {}), (mars_loss, {"ar_weight": 0.0})):
        adapter.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # the same phases for both
        options = LossOptions(4, mask_id, masking=masking, **kwargs)
        terms = loss_fn(model, batch["input_ids"], batch["labels"], options, **extra)
        terms["loss"].backward()
        results.append((terms["loss"].detach(), _grads(adapter)))
    (exact_loss, exact_grads), (full_loss, full_grads) = results
    torch.testing.assert_close(exact_loss, full_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(exact_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_clean_pass_is_the_frozen_model_bit_for_bit(setup):
    model, adapter, mask_id, examples, tok = setup
    batch = collate(examples, tok.pad_token_id, 4, tok.eos_token_id)
    two = two_stream_batch(batch["input_ids"], batch["labels"], 4, mask_id)
    vocab = model.get_output_embeddings().weight.shape[0]
    _, (ids, probs) = clean_pass(model, two, top_k=vocab)
    adapter.attach(model)
    _, (ids_adapted, probs_adapted) = clean_pass(model, two, top_k=vocab)
    assert probs.sum() > 0
    assert torch.equal(ids, ids_adapted) and torch.equal(probs, probs_adapted)


def test_mask_offsets_agree_with_the_attention_mask():
    torch.manual_seed(0)
    ids = torch.randint(5, 50, (3, 23))
    labels = torch.where(torch.arange(23) >= torch.tensor([[4], [9], [13]]), ids, -100)
    for masking in (Masking(), Masking(random_phase=True, streams=4)):
        phases = masking.phases(None, 3, 4)
        two = two_stream_batch(ids, labels, 4, 99, phases=phases)
        width = ids.shape[1]
        is_mask = two.noisy_labels != -100
        dense = two.attention_mask[:, :, width:]
        expected = mask_offsets(is_mask, dense)
        assert torch.equal(two.mask_offsets()[is_mask], expected[is_mask])
        assert int(two.mask_offsets().max()) == 3


def test_b_streams_train_every_token_at_every_offset():
    ids = torch.arange(5, 29)[None]
    labels = torch.where(torch.arange(24) >= 6, ids, -100)
    torch.manual_seed(1)
    two = two_stream_batch(ids, labels, 4, 99, phases=Masking(random_phase=True, streams=4).phases(None, 1, 4))
    width = ids.shape[1]
    offsets = {}  # label position -> block offsets of the noisy columns that predict it
    pos, phase = two.position_ids[0, width:], two.phases[0, width:]
    for i in range(1, len(pos)):
        if two.noisy_labels[0, i] != -100 and pos[i] == pos[i - 1] + 1:
            offsets.setdefault(int(pos[i]), set()).add(int((pos[i - 1] + phase[i - 1]) % 4))
    assert len(offsets) == 24 - 6
    assert all(seen == {0, 1, 2, 3} for seen in offsets.values())


def test_random_phases_are_seeded_and_change_between_steps():
    draw = Masking(random_phase=True, streams=2).phases
    torch.manual_seed(0)
    first, second = draw(None, 8, 4), draw(None, 8, 4)
    torch.manual_seed(0)
    assert torch.equal(draw(None, 8, 4), first)
    assert not torch.equal(first, second)
    assert (first[..., 0] != first[..., 1]).all()  # the copies of a sequence take distinct phases


def test_offset_decay_zero_trains_only_the_first_offset(setup):
    """With the weight of offset o at decay ** o, decay 0 leaves only offset-0 masks in the loss:
    the rows of the later offsets get no gradient, and do with decay 1."""
    model, adapter, mask_id, examples, tok = setup
    adapter.attach(model)
    batch = collate(examples, tok.pad_token_id, 4, tok.eos_token_id)
    for decay, later_rows_move in ((0.0, False), (1.0, True)):
        adapter.zero_grad(set_to_none=True)
        masking = Masking(offset_decay=decay)
        exact_mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, mask_id, masking=masking))[
            "loss"
        ].backward()
        assert adapter.rows.grad[0].abs().sum() > 0
        assert bool(adapter.rows.grad[1:].abs().sum() > 0) == later_rows_move


def test_soft_targets_from_the_clean_stream_are_a_fixed_point(setup):
    """A mask whose output already is the clean stream's distribution for its token is at the
    minimum of the soft loss: with share 1 and full top-k, gradient zero when the masks output the
    clean logits. Checked the other way round: the loss with share 1 is the cross-entropy to the
    clean distribution, larger than that distribution's own entropy."""
    model, adapter, mask_id, examples, tok = setup
    adapter.attach(model)
    batch = collate(examples, tok.pad_token_id, 4, tok.eos_token_id)
    hard = exact_mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, mask_id))["loss"]
    soft = exact_mars_loss(
        model, batch["input_ids"], batch["labels"], LossOptions(4, mask_id, soft_masked=1.0, teacher_top_k=8)
    )
    assert torch.isfinite(soft["loss"]) and not torch.isclose(soft["loss"], hard)


def test_several_copies_average_their_losses(setup):
    """Two copies at phases 0 and 1 give the mean of the two one-copy losses at those phases."""
    model, adapter, mask_id, examples, tok = setup
    adapter.attach(model)
    batch = collate(examples, tok.pad_token_id, 4, tok.eos_token_id)

    @dataclass(frozen=True)
    class AtPhase(Masking):
        phase: int = 0

        def phases(self, segment_ids, rows, block_size):
            return torch.full((rows, 1, 1), self.phase, dtype=torch.long)

    def loss(masking):
        return exact_mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, mask_id, masking=masking))[
            "loss"
        ]

    one, other = AtPhase(phase=0), AtPhase(phase=1)
    with torch.no_grad():
        both = loss(Masking(streams=2))
        torch.testing.assert_close(both, (loss(one) + loss(other)) / 2, rtol=1e-5, atol=1e-6)
