"""Cross-entropy at the target columns only, with the output projection fused into the loss.

A causal LM's forward ends with ``logits = lm_head(hidden)`` at every column. Training reads
only the columns whose next token is a target, and a MARS batch has two streams, so most of a
``[rows, columns, vocab]`` float32 logits tensor (and its gradient) is never used: with a 152k
vocabulary that is tens of GiB per row at 8k columns. Here the logits exist only for the targets,
a chunk of them at a time, and the gradients of the projection are computed chunk by chunk in the
forward (as Liger's fused linear cross-entropy does): the peak is one chunk's logits, whatever the
length.

The loss must still be computed *inside* the model's forward, where FSDP and DeepSpeed ZeRO-3
have gathered the projection's weight. :func:`target_loss` therefore swaps the output
projection's ``forward`` for the duration of one call: the model computes its hidden states as
usual and hands them to the projection, which returns the weighted loss instead of logits.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .modeling import unwrap_model

# Logit elements per chunk: 2^26 float32 logits are 256 MiB, plus as much for their gradient.
CHUNK_ELEMENTS = 2**26


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i weights_i * CE(hidden_i @ W^T + b, labels_i)``, and the per-target CE (not differentiable).

    The gradients with respect to ``hidden``, ``W`` and ``b`` are computed in the forward, chunk
    by chunk, and scaled by the incoming gradient in the backward: no logits outlive their chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, softcap, chunk_rows):
        needs_grad = any(ctx.needs_input_grad[:3])
        ce = torch.empty(len(labels), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for start in range(0, len(labels), chunk_rows):
            end = min(start + chunk_rows, len(labels))
            h = hidden[start:end]
            raw = F.linear(h, weight, bias).float()
            logits = softcap * torch.tanh(raw / softcap) if softcap else raw
            lse = torch.logsumexp(logits, dim=-1)
            y = labels[start:end]
            ce[start:end] = lse - logits.gather(1, y[:, None])[:, 0]
            if not needs_grad:
                continue
            # d CE / d logits = softmax - onehot, then through the softcap's tanh
            grad = torch.exp(logits - lse[:, None])
            grad[torch.arange(end - start, device=grad.device), y] -= 1
            if softcap:
                grad *= 1 - (logits / softcap) ** 2
            grad *= weights[start:end, None]
            grad_w = grad.to(weight.dtype) if weight.dtype != torch.float32 else grad
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_w @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad.T @ h.float()
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias)))
        ctx.has = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(ce)
        return (ce * weights).sum(), ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce):
        grads = []
        for saved, has, dtype in zip(ctx.saved_tensors, ctx.has, ctx.dtypes):
            grads.append((saved * grad_loss).to(dtype) if has else None)
        return (*grads, None, None, None, None)


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def fused_cross_entropy(head, hidden, labels, weights, softcap=None, rows_per_chunk=None):
    """``(weighted sum, per-target CE)`` of ``head`` (a Linear) applied to ``hidden [n, H]``."""
    rows = rows_per_chunk or chunk_rows(head.weight.shape[0])
    return _FusedLinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, weights.float(), softcap, rows)


@contextmanager
def _head_returns(model, replacement):
    """Within the block, the model's output projection returns ``replacement(hidden)`` instead of logits.

    Logit soft-capping (Gemma 2 / 3) is applied by the model after its head; it is switched off
    here and done inside the loss instead, where it belongs to the logits.
    """
    inner = unwrap_model(model)
    head = inner.get_output_embeddings()
    config = inner.config
    softcap = getattr(config, "final_logit_softcapping", None)
    head.forward = lambda hidden: replacement(head, hidden, softcap)
    if softcap is not None:
        config.final_logit_softcapping = None
    try:
        yield
    finally:
        del head.forward  # the instance attribute: the class's forward shows through again
        if softcap is not None:
            config.final_logit_softcapping = softcap


def has_linear_head(model) -> bool:
    """Whether the model's output projection is a plain Linear, which the fused loss needs (a
    quantised or wrapped head is left to the model's own forward and full logits)."""
    return isinstance(unwrap_model(model).get_output_embeddings(), torch.nn.Linear)


def target_loss(model, inputs: dict, rows, columns, labels, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``model(**inputs)`` whose output projection runs only at ``(rows, columns)``.

    Returns ``(sum_i weights_i * CE_i, CE)``, where ``CE_i`` is the cross-entropy of the output at
    ``(rows_i, columns_i)`` against ``labels_i``.
    """
    result = {}

    def loss_at_targets(head, hidden, softcap):
        result["loss"], result["ce"] = fused_cross_entropy(head, hidden[rows, columns], labels, weights, softcap)
        return result["loss"]

    with _head_returns(model, loss_at_targets):
        model(**inputs)
    return result["loss"], result["ce"]
