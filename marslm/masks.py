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

import functools

import numpy as np
import torch

from .errors import UserError
from .unwrap import attention_implementation, unwrap_model


def two_stream_mask(seq_len: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``[2L, 2L]`` training mask over ``[clean ; noisy]`` of one sequence, True where a query may attend."""
    positions = torch.arange(seq_len, device=device).repeat(2)[None]
    noisy = (torch.arange(2 * seq_len, device=device) >= seq_len)[None]
    return packed_two_stream_mask(positions, torch.zeros_like(positions), noisy, block_size)[0, 0]


def _visible(q_pos, k_pos, q_stream, k_stream, q_seg, k_seg, q_phase, block_size: int):
    """The rule above, elementwise over broadcastable query (q_*) and key (k_*) descriptors.

    A stream is 0 for the clean one and s >= 1 for the s-th noisy copy (a bool: one copy); a
    noisy copy counts its blocks from its own phase, ``blk(p) = (p + phase) // B``, so each copy
    puts every token at another offset inside its block. Copies never see each other.

    Blocks are compared through the position where the query's block starts (in its copy's
    phase), a per-query number: ``blk(k) < blk(q)`` is ``k < start(q)``, and inside the block
    and causal is ``start(q) <= k <= q``. So every per-pair tensor is a boolean; no integer
    block index is computed for each (query, key) pair (that cost 8 bytes a pair, issue 50).
    """
    q_noisy, k_noisy = q_stream > 0, k_stream > 0
    q_start = (q_pos + q_phase) // block_size * block_size - q_phase
    causal = k_pos <= q_pos
    before_block = k_pos < q_start
    clean_to_clean = ~q_noisy & ~k_noisy & causal
    noisy_to_noisy = q_noisy & (k_stream == q_stream) & ~before_block & causal
    noisy_to_clean = q_noisy & ~k_noisy & before_block
    return (clean_to_clean | noisy_to_noisy | noisy_to_clean) & (q_seg == k_seg)


def packed_two_stream_mask(
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    streams: torch.Tensor,
    block_size: int,
    phases: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[rows, 1, W, W]`` training mask for rows that hold several sequences' two streams.

    ``position_ids`` / ``segment_ids`` / ``streams`` ``[rows, W]`` describe every column: its
    position inside its own sequence, which sequence of the row it belongs to (-1: padding), and
    which stream (0 clean, s >= 1 the s-th noisy copy; a bool says noisy or not). ``phases``
    ``[rows, W]``: the block phase of each noisy column's copy (None: 0). Attention never crosses
    a sequence; inside one, the rule above holds. Blocks are counted from each sequence's start
    (shifted by the phase), so every sequence is EOS-padded to a multiple of B
    (objective.pad_to_block). Nothing here needs a stream to be complete or in order: the training
    batch leaves out the noisy columns no loss depends on (objective.two_stream_batch).
    """
    _check_block_size(block_size)
    q, k = (slice(None), slice(None), None), (slice(None), None, slice(None))
    phases = torch.zeros_like(position_ids) if phases is None else phases
    return _visible(
        position_ids[q],
        position_ids[k],
        streams[q],
        streams[k],
        segment_ids[q],
        segment_ids[k],
        phases[q],
        block_size,
    )[:, None]


def two_stream_block_mask(
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    streams: torch.Tensor,
    block_size: int,
    phases: torch.Tensor | None = None,
    first_query: int = 0,
):
    """The same mask as :func:`packed_two_stream_mask`, as a FlexAttention ``BlockMask``, for the
    queries from column ``first_query`` on (the keys are every column).

    FlexAttention evaluates the rule per tile and skips the tiles where it is false everywhere (a
    clean query never sees the noisy stream; a noisy one sees only its own block of it), and no
    ``[W, W]`` tensor is ever built.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    _check_block_size(block_size)
    phases = torch.zeros_like(position_ids) if phases is None else phases

    def mask_mod(b, h, q, k):
        q = q + first_query
        return _visible(
            position_ids[b, q],
            position_ids[b, k],
            streams[b, q],
            streams[b, k],
            segment_ids[b, q],
            segment_ids[b, k],
            phases[b, q],
            block_size,
        )

    rows, width = position_ids.shape
    return create_block_mask(
        mask_mod, B=rows, H=None, Q_LEN=width - first_query, KV_LEN=width, device=position_ids.device
    )


def training_mask(
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    streams: torch.Tensor,
    block_size: int,
    model,
    phases: torch.Tensor | None = None,
    first_query: int = 0,
):
    """The training mask in the form the model's attention back-end takes: a ``BlockMask`` for
    FlexAttention, else the dense mask through :func:`for_attention`; for the queries from column
    ``first_query`` on (a forward that feeds only those, over a cache of the columns before).

    sdpa gets the additive form, built once here in the dtype its queries will have: handed a
    boolean mask, torch turns it into that same additive mask at every call, which is every layer,
    and keeps each layer's copy for the backward (4 bytes a pair per layer; issue 50)."""
    impl = attention_implementation(model)
    if impl == "flex_attention":
        return two_stream_block_mask(position_ids, segment_ids, streams, block_size, phases, first_query)
    dense = packed_two_stream_mask(position_ids, segment_ids, streams, block_size, phases)[:, :, first_query:]
    if impl == "sdpa":
        return additive_mask(dense, _attention_dtype(model, dense.device))
    return for_attention(dense, model)


CLEAN_WIDTH = "mars_clean_width"  # a two-stream forward's keyword to its attention: where the clean stream ends
CLEAN_CAUSAL = "mars_clean_causal"  # and whether that stream is plain causal attention (one sequence a row)


def split_attention(model, clean_width: int, segment_ids: torch.Tensor | None) -> dict:
    """The keywords that let sdpa attend the two streams apart in a training forward: the clean
    stream's queries see only clean keys, so they attend over ``clean_width`` keys (causally, with
    no mask at all, where each row holds one sequence), and only the noisy queries read the whole
    width. transformers hands a forward's keywords to its attention function; :func:`two_stream_sdpa`
    reads them. Other back-ends get none (FlexAttention's block mask skips the blocks itself)."""
    if attention_implementation(model) != "sdpa":
        return {}
    _register_two_stream_sdpa()
    one_sequence = segment_ids is None or bool((segment_ids[:, :clean_width] <= 0).all())
    return {CLEAN_WIDTH: clean_width, CLEAN_CAUSAL: one_sequence}


@functools.cache
def _register_two_stream_sdpa() -> None:
    """Put :func:`two_stream_sdpa` in transformers' attention registry under "sdpa": a forward
    without the two-stream keywords runs transformers' own function, unchanged."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa", functools.partial(two_stream_sdpa, sdpa_attention_forward))


def two_stream_sdpa(sdpa, module, query, key, value, attention_mask, **kwargs):
    """``sdpa`` (transformers' sdpa attention) over a two-stream training forward, one call per
    stream: the clean queries over the clean keys, the noisy ones over every key. Equal to one call
    over the whole mask (the clean stream never sees the noisy one), at about three quarters of its
    cost with one noisy copy, and less where the clean stream is plain causal."""
    width, causal = kwargs.pop(CLEAN_WIDTH, None), kwargs.pop(CLEAN_CAUSAL, False)
    if width is None or attention_mask is None or query.shape[2] != key.shape[2] or width >= query.shape[2]:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    keys, values = key[:, :, :width], value[:, :, :width]
    clean_mask = None if causal else attention_mask[:, :, :width, :width]
    clean, _ = sdpa(module, query[:, :, :width], keys, values, clean_mask, **kwargs)
    noisy, _ = sdpa(module, query[:, :, width:], key, value, attention_mask[:, :, width:], **kwargs)
    return torch.cat([clean, noisy], dim=1), None


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the scores' addend: 0 where True, the dtype's lowest
    value elsewhere (what eager needs, and what sdpa makes of a boolean mask at each call)."""
    return torch.full(mask.shape, torch.finfo(dtype).min, dtype=dtype, device=mask.device).masked_fill_(mask, 0)


def _attention_dtype(model, device: torch.device) -> torch.dtype:
    """The dtype attention computes in: autocast's where it is on (mixed precision), else the model's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return unwrap_model(model).dtype


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise UserError(f"block size must be >= 1, got {block_size}")


def decode_step_mask(
    slot_valid: np.ndarray,
    real_valid: np.ndarray,
    group_sees: np.ndarray,
    group_valid: np.ndarray,
    n_masks: int,
    causal_as_none: bool = False,
) -> np.ndarray | None:
    """Mask for one decoding forward over a (possibly empty) KV cache, built on the host.

    A step feeds, per row, ``[real | group_0 | ... | group_{G-1}]``:

    - real: the row's tokens not yet in the cache, then its drafts to verify (lossless mode),
      packed to the left and attended causally;
    - groups of ``n_masks`` masks; group g sees the first ``group_sees[g]`` real tokens (those not
      cached, then as many drafts as it was placed after), is causal inside itself and invisible
      to everything else (the paper, section 4.6). The threshold mode is the special case of no
      draft and one group.

    slot_valid ``[batch, S]``: cached slots holding a committed token of that row (ragged
    acceptance leaves holes). real_valid ``[batch, Wr]`` (valid columns first),
    group_sees / group_valid ``[batch, G]``. numpy arrays: the decoding loop keeps its row state
    on the host (as vLLM's input batch does) and ships the finished mask in one copy.

    Returns ``[batch, 1, W, S + W]``. Each query also sees itself, so no row is fully masked
    (sdpa would return NaN there); outputs of padding columns are ignored. With ``causal_as_none``,
    returns None where the mask is plain causal attention over every cached slot and fed token (no
    holes, no padding): the model's own causal mask is then the same, and transformers skips it
    for a one-token step, as in HF ``generate``.
    """
    if group_sees.shape[1] == 1 and np.array_equal(group_sees[:, 0], real_valid.sum(axis=1)):
        # One mask group that sees every real token (threshold mode, or one group after the whole
        # draft): the fed block is plain causal attention over its valid tokens. The common case,
        # and a hot path on small models.
        fed_valid = np.concatenate([real_valid, group_valid.repeat(n_masks, axis=1)], axis=1)
        if causal_as_none and slot_valid.all() and fed_valid.all():
            return None
        return causal_step_mask(slot_valid, fed_valid)
    return _grouped_step_mask(slot_valid, real_valid, group_sees, group_valid, n_masks)


def _grouped_step_mask(slot_valid, real_valid, group_sees, group_valid, n_masks):
    """decode_step_mask's general case: several mask groups, each seeing its own prefix of the real tokens."""
    batch, width_real = real_valid.shape
    groups = group_sees.shape[1]
    is_mask = np.repeat([False, True], [width_real, groups * n_masks])
    idx = np.concatenate([np.arange(width_real), np.tile(np.arange(n_masks), groups)])
    grp = np.concatenate([np.full(width_real, -1), np.repeat(np.arange(groups), n_masks)])
    fed_valid = np.concatenate([real_valid, np.repeat(group_valid, n_masks, axis=1)], axis=1)
    sees = np.concatenate([np.zeros((batch, width_real), np.int64), np.repeat(group_sees, n_masks, axis=1)], axis=1)

    causal_within = (idx[None, :] <= idx[:, None]) & (grp[None, :] == grp[:, None])
    # a real token sees the real tokens up to itself; a mask those of its own group up to itself
    fed = causal_within[None]
    # and a group the real tokens it was placed after, which depends on the row
    group_to_real = is_mask[None, :, None] & ~is_mask[None, None, :] & (idx[None, None, :] < sees[:, :, None])
    width = len(idx)
    fed = ((fed | group_to_real) & fed_valid[:, None, :]) | _identity(width)
    cached = np.broadcast_to(slot_valid[:, None, :], (batch, width, slot_valid.shape[1]))
    return np.concatenate([cached, fed], axis=-1)[:, None]


def causal_step_mask(slot_valid: np.ndarray, fed_valid: np.ndarray) -> np.ndarray:
    """``[batch, 1, W, S + W]``: fed tokens see the valid cached slots and, causally, the valid fed
    tokens; each also sees itself, so no query row is fully masked."""
    width = fed_valid.shape[1]
    fed = _lower_triangle(width) & (fed_valid[:, None, :] | _identity(width))
    cached = slot_valid[:, None, :].repeat(width, axis=1)
    return np.concatenate([cached, fed], axis=-1)[:, None]


# The decoding step calls these at every forward with a handful of widths.
@functools.lru_cache(maxsize=256)
def _lower_triangle(width: int) -> np.ndarray:
    return np.tri(width, dtype=bool)


@functools.lru_cache(maxsize=256)
def _identity(width: int) -> np.ndarray:
    return np.eye(width, dtype=bool)


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
        return additive_mask(mask, dtype or unwrap_model(model).dtype)
    raise UserError(
        f"attention implementation {impl!r} cannot take MARS's structured mask; "
        "load the model with attn_implementation='sdpa' (or 'eager')"
    )
