"""Attention masks: the one place where MARS's visibility rule is written down.

Training runs the model on a two-stream input ``z = [x ; x~]`` of length 2L, where ``x~`` is
``x`` with every response token replaced by ``<|mask|>``. Both halves use position ids 0..L-1.
With ``p`` the position inside a token's own half and ``blk(p) = p // B``, query i may attend to
key j when:

    clean -> clean   p(j) <= p(i)                              the ordinary AR stream
    noisy -> noisy   blk(p(j)) == blk(p(i)) and p(j) <= p(i)   causal inside the block
    noisy -> clean   blk(p(j)) <  blk(p(i))                    every earlier block, clean
    clean -> noisy   never                                     the AR stream stays pure AR

Decoding needs no special rule at all: the masks appended after a clean prefix are attended
causally, which is the noisy -> noisy / noisy -> clean rule seen from a block that starts at the
prefix end. What decoding does need is per-row bookkeeping (ragged prompts, cached slots that
hold nothing), expressed by :func:`decode_step_mask`.

All masks here are boolean (True = may attend). :func:`for_attention` turns one into what the
model's attention back-end expects, because back-ends disagree on what a mask *means*.
"""

from __future__ import annotations

import torch

from .errors import UserError


def two_stream_mask(seq_len: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``[2L, 2L]`` training mask over ``[clean ; noisy]``, True where a query may attend."""
    if block_size < 1:
        raise UserError(f"block size must be >= 1, got {block_size}")
    pos = torch.arange(seq_len, device=device).repeat(2)
    noisy = torch.arange(2 * seq_len, device=device) >= seq_len
    blk = pos // block_size

    q_pos, k_pos = pos[:, None], pos[None, :]
    q_blk, k_blk = blk[:, None], blk[None, :]
    q_noisy, k_noisy = noisy[:, None], noisy[None, :]

    causal = k_pos <= q_pos
    clean_to_clean = ~q_noisy & ~k_noisy & causal
    noisy_to_noisy = q_noisy & k_noisy & (k_blk == q_blk) & causal
    noisy_to_clean = q_noisy & ~k_noisy & (k_blk < q_blk)
    return clean_to_clean | noisy_to_noisy | noisy_to_clean


def decode_step_mask(slot_valid: torch.Tensor, fed_valid: torch.Tensor) -> torch.Tensor:
    """Mask for one decoding forward over a (possibly empty) KV cache.

    slot_valid: ``[batch, S]`` which cached slots hold a committed token of that row (ragged
        acceptance and row padding leave holes).
    fed_valid: ``[batch, W]`` which fed columns are real (pending tokens or masks, not padding).

    Returns ``[batch, 1, W, S + W]``: a fed query sees every valid cached slot and the valid fed
    columns up to itself. Each query also sees itself, so a padding row is never fully masked
    (sdpa would return NaN there); its output is ignored anyway.
    """
    batch, width = fed_valid.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=fed_valid.device).tril()
    fed_keys = causal[None] & fed_valid[:, None, :]
    fed_keys |= torch.eye(width, dtype=torch.bool, device=fed_valid.device)[None]
    cached_keys = slot_valid[:, None, :].expand(batch, width, slot_valid.shape[1])
    return torch.cat([cached_keys, fed_keys], dim=-1)[:, None]


def attention_implementation(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def for_attention(mask: torch.Tensor, model, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Convert a boolean ``[batch, 1, q, kv]`` mask into the form the model's back-end honours.

    transformers passes a 4-D mask through untouched. sdpa reads a boolean mask as "True =
    attend"; eager *adds* the mask to the scores, so a boolean there is silently wrong and it
    needs 0 / large-negative floats. Kernels that cannot take an arbitrary mask are refused.
    """
    impl = attention_implementation(model)
    if impl == "sdpa":
        return mask
    if impl == "eager":
        dtype = dtype or model.dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill_(~mask, torch.finfo(dtype).min)
    raise UserError(
        f"attention implementation {impl!r} cannot take MARS's structured mask; "
        "load the model with attn_implementation='sdpa' (or 'eager')"
    )
