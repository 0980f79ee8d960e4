"""Target-only logits (head_loss.py): the loss and every gradient equal the full-logits path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from marslm.chat import encode_conversation
from marslm.training.collate import collate, collate_packed
from marslm.training.head_loss import SparseTargets, fused_cross_entropy
from marslm.training.objective import LossOptions, ar_loss, mars_loss
from tests.helpers import assert_same_loss_and_grads, stage_loss_and_grads

MASK_ID, EOS_ID, PAD_ID = 3, 2, 0


def _literal_soft_ce(logits, targets: SparseTargets):
    """The soft cross-entropy written out over the whole vocabulary (autograd gives its gradient)."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    dense = torch.zeros_like(log_q).scatter_add(1, targets.ids, targets.probs)
    on = dense > 0
    rest = (1 - targets.probs.sum(-1)).clamp(min=0)
    outside = torch.log1p(-log_q.exp().masked_fill(~on, 0).sum(-1))
    return -(dense * log_q.masked_fill(~on, 0)).sum(-1) - rest * outside


def _soft_targets(n, vocab, k):
    """Rows of every kind: a hard label, a top-k with mass left over, a token repeated, all mass."""
    ids = torch.randint(0, vocab, (n, k))
    probs = torch.rand(n, k)
    probs = probs / probs.sum(-1, keepdim=True) * torch.rand(n, 1)  # each row keeps some mass back
    probs[0] = torch.tensor([1.0] + [0.0] * (k - 1))
    ids[1, 1] = ids[1, 0]
    probs[2] = probs[2] / probs[2].sum()
    return SparseTargets(ids, probs)


@pytest.mark.parametrize("kind", ["labels", "soft"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fused_cross_entropy_equals_the_literal_loss_in_small_chunks(kind, bias, softcap):
    """Labels against torch's own cross-entropy; soft targets against the formula written out."""
    torch.manual_seed(0 if kind == "labels" else 1)
    head = torch.nn.Linear(8, 11, bias=bias)
    hidden = torch.randn(7, 8, requires_grad=True)
    targets = torch.randint(0, 11, (7,)) if kind == "labels" else _soft_targets(7, 11, 4)
    weights = torch.rand(7)

    loss, ce = fused_cross_entropy(head, hidden, targets, weights, softcap, rows_per_chunk=3)
    loss.backward()
    ours = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    hidden.grad = None
    head.zero_grad()

    logits = head(hidden)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if kind == "labels":
        literal_ce = F.cross_entropy(logits, targets, reduction="none")
    else:
        literal_ce = _literal_soft_ce(logits, targets)
    (literal_ce * weights).sum().backward()
    literal = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])

    torch.testing.assert_close(ce, literal_ce.detach())
    torch.testing.assert_close(loss.detach(), (literal_ce * weights).sum().detach())
    for got, want in zip(ours, literal):
        torch.testing.assert_close(got, want)


def test_a_kept_top_k_is_a_fixed_point_of_the_soft_loss():
    """The model whose distribution the targets were taken from gets no gradient: the anchor pulls
    back from drift and does not sharpen (hard labels, or top-k renormalised, would)."""
    torch.manual_seed(2)
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(5, 8, requires_grad=True)
    top = torch.softmax(head(hidden), dim=-1).topk(6)
    loss, _ = fused_cross_entropy(head, hidden, SparseTargets(top.indices, top.values.detach()), torch.ones(5))
    loss.backward()
    assert hidden.grad.abs().max() < 1e-6
    assert head.weight.grad.abs().max() < 1e-6
    renormalised = SparseTargets(top.indices, (top.values / top.values.sum(-1, keepdim=True)).detach())
    hidden.grad = None
    fused_cross_entropy(head, hidden, renormalised, torch.ones(5))[0].backward()
    assert hidden.grad.abs().max() > 1e-3


def _examples(tokenizer, n=8):
    from marslm.data import toy

    out = []
    for example in toy.make_split("train", n):
        enc = encode_conversation(tokenizer, toy.to_chat_record(example)["messages"])
        out.append({"input_ids": enc.input_ids, "labels": enc.labels})
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_target_only_logits_give_the_full_logits_loss_and_gradients(
    tiny_tokenizer, make_tiny_model, stage, normalization, packed
):
    block_size = 4 if stage == "mars" else 1
    collate_fn = collate_packed if packed else collate
    batch = collate_fn(_examples(tiny_tokenizer), pad_id=PAD_ID, block_size=block_size, eos_id=EOS_ID)

    def run(target_logits):
        model = make_tiny_model(seed=4).train()
        options = {"ar_weight": 0.7} if stage == "mars" else {}
        return stage_loss_and_grads(
            model, batch, stage, normalization=normalization, target_logits=target_logits, **options
        )

    assert_same_loss_and_grads(run(True), run(False), loss_atol=1e-6)


def test_target_only_logits_under_cpu_bf16_autocast(tiny_tokenizer, make_tiny_model):
    batch = collate(_examples(tiny_tokenizer, 4), pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    model = make_tiny_model(seed=2).train()
    losses = []
    for target_logits in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            terms = mars_loss(
                model, batch["input_ids"], batch["labels"], LossOptions(4, MASK_ID, target_logits=target_logits)
            )
        terms["loss"].backward()
        losses.append(terms["loss"].detach())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=2e-2)


def test_the_output_projection_is_restored_after_the_loss(tiny_tokenizer, make_tiny_model):
    model = make_tiny_model()
    batch = collate(_examples(tiny_tokenizer, 2), pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, MASK_ID))
    assert "forward" not in model.get_output_embeddings().__dict__
    assert model(input_ids=batch["input_ids"]).logits.shape[-1] == model.config.vocab_size


@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_no_logits_over_the_vocabulary_are_kept_for_the_backward(tiny_tokenizer, make_tiny_model, stage):
    """What the backward keeps grows with the targets times the hidden size, never with the
    columns times the vocabulary: no saved tensor has the vocabulary as its last dimension."""
    batch = collate(_examples(tiny_tokenizer, 4), pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    model = make_tiny_model().train()
    vocab = model.get_output_embeddings().weight.shape[0]

    def saved_shapes(target_logits):
        shapes = []

        def pack(tensor):
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if stage == "mars":
                mars_loss(
                    model, batch["input_ids"], batch["labels"], LossOptions(4, MASK_ID, target_logits=target_logits)
                )
            else:
                ar_loss(model, batch["input_ids"], batch["labels"], target_logits=target_logits)
        return shapes

    assert any(shape[-1] == vocab for shape in saved_shapes(False))  # the check can see logits
    assert not any(shape and shape[-1] == vocab for shape in saved_shapes(True))


def test_bench_train_step_reports_mars_against_ar(tiny_model_dir, tmp_path):
    import json

    from tests.test_train import run_cli

    out = tmp_path / "r.json"
    rc, text = run_cli(
        "bench", "--train-step", "--model", tiny_model_dir, "--seq-lens", "16,32", "--repeats", "1",
        "--logits", "both", "--quiet", "--json", out,
    )  # fmt: skip
    assert rc == 0 and "| MARS |" in text
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["seq_len"], r["logits"], r["stage"]) for r in rows} == {
        (n, logits, stage) for n in (16, 32) for logits in ("targets", "full") for stage in ("ar", "mars")
    }
    assert all(r["seconds"] > 0 for r in rows)
    assert all(r["seconds_vs_ar"] > 0 for r in rows if r["stage"] == "mars")
    rc, _ = run_cli("bench", "--train-step", "--shape", "qwen2.5-0.5b", "--layers", "99")
    assert rc == 2


def test_a_head_that_is_not_a_plain_linear_falls_back_to_full_logits(tiny_tokenizer, make_tiny_model):
    batch = collate(_examples(tiny_tokenizer, 3), pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    model = make_tiny_model()
    expected = mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, MASK_ID))["loss"]
    model.lm_head = torch.nn.Sequential(model.lm_head)  # a wrapped head, as some adapters leave it
    got = mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, MASK_ID))["loss"]
    torch.testing.assert_close(got, expected)
