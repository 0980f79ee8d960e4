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

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..unwrap import unwrap_model

# Logit elements per chunk: 2^26 float32 logits are 256 MiB, plus as much for their gradient.
CHUNK_ELEMENTS = 2**26


@dataclass
class SparseTargets:
    """``n`` target distributions, each ``probs[i]`` on the tokens ``ids[i]`` (``[n, k]`` each; a
    token may repeat, its probabilities add up; what they leave is spread over the other tokens)."""

    ids: torch.Tensor
    probs: torch.Tensor

    @classmethod
    def hard(cls, labels: torch.Tensor) -> SparseTargets:
        return cls(labels[:, None], torch.ones(len(labels), 1, device=labels.device))

    @classmethod
    def cat(cls, *parts) -> torch.Tensor | SparseTargets:
        """One set of targets from several (labels stay labels when every part is labels)."""
        if all(isinstance(part, torch.Tensor) for part in parts):
            return torch.cat(parts)
        parts = [cls.hard(part) if isinstance(part, torch.Tensor) else part for part in parts]
        k = max(part.ids.shape[1] for part in parts)
        # zero-probability columns add nothing to a target: they only pad to a common width
        return cls(
            torch.cat([F.pad(part.ids, (0, k - part.ids.shape[1])) for part in parts]),
            torch.cat([F.pad(part.probs, (0, k - part.probs.shape[1])) for part in parts]),
        )

    def __len__(self) -> int:
        return len(self.ids)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i weights_i * CE(t_i, softmax(hidden_i @ W^T + b))``, and the per-target CE (not differentiable).

    Each target ``t_i`` is a sparse distribution: probabilities ``probs_i`` on the tokens ``ids_i``
    (a hard label is one token at probability 1). What they leave, ``r_i = 1 - sum(probs_i)``, is
    the target's mass on every other token, matched as one bucket:

        CE_i = - sum_j t_ij log q_ij - r_i log(1 - Q_i),    Q_i = q_i's mass on the tokens of t_i

    so a top-k distribution kept from a model is a fixed point when the model still gives it: the
    gradient with respect to the logits is ``q - t`` on the target's tokens and
    ``q * (1 - r / (1 - Q))`` elsewhere, zero when ``q`` is the kept distribution.

    The gradients with respect to ``hidden``, ``W`` and ``b`` are computed in the forward, chunk
    by chunk, and scaled by the incoming gradient in the backward: no logits outlive their chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, probs, weights, softcap, chunk_rows):
        needs_grad = any(ctx.needs_input_grad[:3])
        ce = torch.empty(len(ids), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for start in range(0, len(ids), chunk_rows):
            end = min(start + chunk_rows, len(ids))
            h = hidden[start:end]
            raw = F.linear(h, weight, bias).float()
            logits = softcap * torch.tanh(raw / softcap) if softcap else raw
            ce[start:end], grad = _soft_cross_entropy(logits, ids[start:end], probs[start:end], needs_grad)
            if not needs_grad:
                continue
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
        return (*grads, None, None, None, None, None)


def _soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, with_grad: bool):
    """Per row, the cross-entropy of ``softmax(logits)`` against the sparse target ``(ids, probs)``
    (its missing mass as one bucket: see _FusedLinearCrossEntropy), and the gradient with respect
    to the logits (None without ``with_grad``)."""
    lse = torch.logsumexp(logits, dim=-1)
    if ids.shape[1] == 1 and bool((probs == 1).all()):  # hard labels: the usual CE, no dense target
        ce = lse - logits.gather(1, ids)[:, 0]
        if not with_grad:
            return ce, None
        grad = torch.exp(logits - lse[:, None])
        grad[torch.arange(len(ids), device=grad.device), ids[:, 0]] -= 1
        return ce, grad
    target = torch.zeros_like(logits).scatter_add_(1, ids, probs)
    on = target > 0
    rest = (1 - probs.sum(dim=-1)).clamp(min=0)
    spread = rest > 0
    any_spread = bool(spread.any())  # one device sync for the chunk
    ce = -(target * torch.where(on, logits - lse[:, None], 0)).sum(dim=-1)
    if any_spread:
        log_outside = torch.logsumexp(logits.masked_fill(on, float("-inf")), dim=-1) - lse  # log(1 - Q)
        ce = ce - torch.where(spread, rest * log_outside, 0)
    if not with_grad:
        return ce, None
    grad = torch.exp(logits - lse[:, None])
    if any_spread:
        outside = 1 - torch.where(spread, rest * torch.exp(-log_outside), 0)
        grad = torch.where(on, grad, grad * outside[:, None])
    return ce, grad - target


def cross_entropy(logits: torch.Tensor, targets) -> torch.Tensor:
    """Per-row CE of ``logits [n, vocab]`` (differentiable) against labels or :class:`SparseTargets`:
    the loss :func:`fused_cross_entropy` computes, written for logits that already exist."""
    targets = SparseTargets.hard(targets) if isinstance(targets, torch.Tensor) else targets
    return _soft_cross_entropy(logits.float(), targets.ids, targets.probs.float(), with_grad=False)[0]


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def fused_cross_entropy(head, hidden, targets, weights, softcap=None, rows_per_chunk=None):
    """``(weighted sum, per-target CE)`` of ``head`` (a Linear) applied to ``hidden [n, H]``.

    ``targets``: ``[n]`` labels, or a :class:`SparseTargets` of ``n`` distributions.
    """
    targets = SparseTargets.hard(targets) if isinstance(targets, torch.Tensor) else targets
    rows = rows_per_chunk or chunk_rows(head.weight.shape[0])
    return _FusedLinearCrossEntropy.apply(
        hidden, head.weight, head.bias, targets.ids, targets.probs.float(), weights.float(), softcap, rows
    )


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


def logits_at(model, keep: torch.Tensor, **inputs) -> torch.Tensor:
    """``[keep.sum(), vocab]``: the logits of the columns where ``keep [rows, columns]`` is True, in
    row-major order; where the model takes ``logits_to_keep``, the other columns never reach the
    output layer, whose output grows with the vocabulary."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        logits = model(**inputs, logits_to_keep=keep).logits
        return logits.reshape(-1, logits.shape[-1])
    return model(**inputs).logits[keep]


def has_linear_head(model) -> bool:
    """Whether the model's output projection is a plain Linear, which the fused loss needs (a
    quantised or wrapped head is left to the model's own forward and full logits)."""
    return isinstance(unwrap_model(model).get_output_embeddings(), torch.nn.Linear)


def target_loss(model, inputs: dict, rows, columns, targets, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``model(**inputs)`` whose output projection runs only at ``(rows, columns)``.

    Returns ``(sum_i weights_i * CE_i, CE)``, where ``CE_i`` is the cross-entropy of the output at
    ``(rows_i, columns_i)`` against ``targets[i]`` (labels, or a :class:`SparseTargets`).
    """
    result = {}

    def loss_at_targets(head, hidden, softcap):
        result["loss"], result["ce"] = fused_cross_entropy(head, hidden[rows, columns], targets, weights, softcap)
        return result["loss"]

    with _head_returns(model, loss_at_targets):
        model(**inputs)
    return result["loss"], result["ce"]
