"""The MARS visibility rule (docs/method.md) and the masks built from it."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from marslm.chat import IGNORE
from marslm.errors import UserError
from marslm.masks import decode_step_mask, for_attention, packed_two_stream_mask, two_stream_mask
from marslm.training.objective import two_stream_batch

MASK_ID = 3


def brute_force_mask(L: int, B: int) -> torch.Tensor:
    """Straight from the spec: z = [x ; x~], p(.) = position in its half, blk(p) = p // B."""
    allowed = [[False] * (2 * L) for _ in range(2 * L)]
    for i in range(2 * L):
        for j in range(2 * L):
            i_noisy, j_noisy = i >= L, j >= L
            pi, pj = i % L, j % L
            bi, bj = pi // B, pj // B
            if not i_noisy and not j_noisy:
                ok = pj <= pi  # clean -> clean: causal
            elif i_noisy and j_noisy:
                ok = bj == bi and pj <= pi  # noisy -> noisy: causal inside the block
            elif i_noisy and not j_noisy:
                ok = bj < bi  # noisy -> clean: every earlier block
            else:
                ok = False  # clean -> noisy: never
            allowed[i][j] = ok
    return torch.tensor(allowed, dtype=torch.bool)


@pytest.mark.parametrize("L,B", list(itertools.product([1, 5, 8, 13], [1, 2, 3, 4, 16])))
def test_two_stream_mask_matches_brute_force(L, B):
    mask = two_stream_mask(L, B)
    assert mask.dtype == torch.bool
    assert mask.shape == (2 * L, 2 * L)
    assert torch.equal(mask, brute_force_mask(L, B))


def test_two_stream_mask_spot_checks():
    L, B = 8, 4
    mask = two_stream_mask(L, B)
    clean, noisy = (lambda p: p), (lambda p: L + p)
    assert mask[clean(5), clean(0)] and mask[clean(5), clean(5)] and not mask[clean(5), clean(6)]
    # the first noisy block sees no clean token at all, only itself causally
    assert not mask[noisy(0), clean(0)] and mask[noisy(0), noisy(0)]
    assert not mask[noisy(3), clean(3)] and mask[noisy(3), noisy(0)] and not mask[noisy(2), noisy(3)]
    # the second block sees the whole first block, clean, but not its own clean tokens
    assert mask[noisy(4), clean(3)] and not mask[noisy(4), clean(4)] and not mask[noisy(4), noisy(3)]
    # clean never sees noisy
    assert not mask[:L, L:].any()
    # every row keeps at least one visible key (no NaN rows under sdpa)
    assert mask.any(dim=1).all()


@pytest.mark.parametrize("B", [1, 2, 4])
def test_packed_two_stream_mask_is_each_sequence_s_own_mask(B):
    lengths = (8, 4, 3)  # two sequences and a padding tail (segment -1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    segment_ids = torch.tensor([0] * 8 + [1] * 4 + [-1] * 3)[None]
    T = sum(lengths)
    noisy = (torch.arange(2 * T) >= T)[None]
    mask = packed_two_stream_mask(position_ids.repeat(1, 2), segment_ids.repeat(1, 2), noisy, B)
    assert mask.shape == (1, 1, 2 * T, 2 * T)
    starts = (0, 8, 12)
    expected = torch.zeros(2 * T, 2 * T, dtype=torch.bool)
    for start, n in zip(starts, lengths):
        own = two_stream_mask(n, B)  # [clean ; noisy] of this sequence alone
        rows_cols = torch.cat([torch.arange(start, start + n), T + torch.arange(start, start + n)])
        expected[rows_cols[:, None], rows_cols[None, :]] = own
    assert torch.equal(mask[0, 0], expected)
    assert mask[0, 0].any(dim=-1).all()  # no query row is left with nothing to attend


def test_the_rule_without_a_noisy_stream_is_causal_inside_each_packed_sequence():
    """AR packing uses the two-stream rule with every column clean (objective.ar_loss)."""
    segment_ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    clean_only = torch.zeros_like(segment_ids, dtype=torch.bool)
    mask = packed_two_stream_mask(torch.tensor([[0, 1, 0, 1, 2, 0]]), segment_ids, clean_only, 1)[0, 0]
    literal = torch.ones(6, 6, dtype=torch.bool).tril() & (segment_ids[0, :, None] == segment_ids[0, None, :])
    assert torch.equal(mask, literal)
    assert mask.tolist()[3] == [False, False, True, True, False, False]


@pytest.mark.parametrize("B", [1, 3, 4])
def test_the_flex_block_mask_is_the_dense_mask(B):
    from torch.nn.attention.flex_attention import create_mask

    from marslm.masks import two_stream_block_mask

    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2], list(range(16))])
    segment_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1], [0] * 8 + [0] * 6 + [-1] * 2])
    is_noisy = (torch.arange(16) >= 8)[None].expand(2, -1)
    position_ids[1] = torch.cat([torch.arange(8), torch.arange(6), torch.zeros(2, dtype=torch.long)])
    dense = packed_two_stream_mask(position_ids, segment_ids, is_noisy, B)
    block = two_stream_block_mask(position_ids, segment_ids, is_noisy, B)
    assert torch.equal(create_mask(block.mask_mod, 2, 1, 16, 16, device="cpu"), dense)


def test_two_stream_mask_rejects_bad_block():
    with pytest.raises(UserError):
        two_stream_mask(4, 0)


@pytest.mark.parametrize("B", [1, 3, 4])
def test_two_stream_batch_with_arbitrary_boundaries(B):
    rng = random.Random(B)
    L, batch = 13, 5
    input_ids = torch.randint(4, 200, (batch, L))
    labels = torch.full((batch, L), IGNORE)
    boundaries = [1, 2, rng.randint(3, L - 2), L - 1, L - 3]
    ends = [L, L, L, L, L - 1]  # the last row is right-padded
    for row, (start, end) in enumerate(zip(boundaries, ends)):
        labels[row, start:end] = input_ids[row, start:end]

    tsb = two_stream_batch(input_ids, labels, B, MASK_ID)

    assert torch.equal(tsb.input_ids[:, :L], input_ids)
    assert torch.equal(tsb.labels, labels)
    reference = brute_force_mask(L, B)
    for row, (start, end) in enumerate(zip(boundaries, ends)):
        # the noisy half copies the columns from the block of the first scored output to the last target
        first = (start - 1) // B * B
        columns = tsb.noisy_columns[row][tsb.noisy_columns[row] >= 0]
        assert columns.tolist() == list(range(first, end))
        noisy = tsb.input_ids[row, L : L + len(columns)]
        assert torch.equal(noisy[: start - first], input_ids[row, first:start])  # prompt stays
        assert (noisy[start - first :] == MASK_ID).all()  # response masked
        assert torch.equal(tsb.noisy_labels[row, : len(columns)], labels[row, columns])
        assert (tsb.noisy_labels[row, len(columns) :] == IGNORE).all()
        assert torch.equal(tsb.position_ids[row, :L], torch.arange(L))
        assert torch.equal(tsb.position_ids[row, L : L + len(columns)], columns)
        # over the columns it keeps, the mask is the spec's two-stream mask
        kept = torch.cat([torch.arange(L), L + columns])
        z = torch.cat([torch.arange(L), L + torch.arange(len(columns))])
        assert torch.equal(tsb.attention_mask[row, 0][z[:, None], z[None, :]], reference[kept[:, None], kept[None, :]])
        assert tsb.attention_mask[row, 0].any(dim=-1).all()  # no query without a key


# ------------------------------------------------------------------ decode_step_mask
#
# A decoding forward feeds [real | group_0 .. group_{G-1}] per row, real = the tokens not cached
# then the drafts. Threshold mode is no drafts and one group of masks; the lossless (speculative)
# mode adds drafts and, with draft groups, K+1 groups.


def bools(rows):
    return np.array(rows, dtype=bool)


def threshold_step_mask(slot_valid, pending_valid, n_masks, group_valid=None):
    batch = pending_valid.shape[0]
    return decode_step_mask(
        slot_valid,
        pending_valid,
        group_sees=pending_valid.sum(axis=1, keepdims=True),
        group_valid=np.ones((batch, 1), bool) if group_valid is None else group_valid,
        n_masks=n_masks,
    )


def test_decode_step_mask_empty_cache_is_causal():
    mask = threshold_step_mask(np.zeros((1, 0), bool), bools([[1, 1]]), n_masks=2)
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == bool
    # prefix tokens then masks appended after them: plain causal attention
    assert np.array_equal(mask[0, 0], np.tri(4, dtype=bool))


def test_decode_step_mask_holes_and_padding():
    slot_valid = bools(
        [
            [1, 0, 1, 1],  # a hole at cached slot 1 (ragged acceptance)
            [0, 0, 1, 0],
        ]
    )
    pending_valid = bools([[1, 1], [1, 0]])  # row 1 has one pending token and a padding column
    mask = threshold_step_mask(slot_valid, pending_valid, n_masks=2)
    assert mask.shape == (2, 1, 4, 4 + 4)
    #                 cached      pending  masks
    row0 = bools(
        [[1, 0, 1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1, 1, 1]]
    )
    row1 = bools(
        [
            [0, 0, 1, 0, 1, 0, 0, 0],
            [0, 0, 1, 0, 1, 1, 0, 0],  # the padding query sees itself only extra (no NaN)
            [0, 0, 1, 0, 1, 0, 1, 0],  # masks skip the padding column
            [0, 0, 1, 0, 1, 0, 1, 1],
        ]
    )
    assert np.array_equal(mask[0, 0], row0)
    assert np.array_equal(mask[1, 0], row1)


def test_decode_step_mask_every_query_sees_itself():
    slot_valid = np.zeros((2, 3), bool)
    pending_valid = bools([[0, 0], [1, 0]])
    mask = threshold_step_mask(slot_valid, pending_valid, n_masks=2, group_valid=bools([[0], [1]]))
    fed = mask[:, 0, :, 3:]
    assert fed.diagonal(axis1=-2, axis2=-1).all()
    assert mask.any(axis=-1).all()
    assert not mask[:, 0, :, :3].any()
    # a row with nothing valid sees nothing but itself
    assert np.array_equal(fed[0], np.eye(4, dtype=bool))


def test_decode_step_mask_draft_groups():
    # one pending token, K=2 drafts, K+1=3 groups of 2 masks; group g sees the first g drafts
    slot_valid = bools([[1, 1]])
    mask = decode_step_mask(
        slot_valid,
        bools([[1, 1, 1]]),
        group_sees=np.array([[1, 2, 3]]),
        group_valid=bools([[1, 1, 1]]),
        n_masks=2,
    )
    assert mask.shape == (1, 1, 9, 2 + 9)
    #               cache  p  d0 d1  g0    g1    g2
    want = bools(
        [
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # pending
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # draft 0
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # draft 1
            [1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0],  # group 0, mask 0
            [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0],  # group 0, mask 1
            [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0],  # group 1 sees draft 0
            [1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0],  # group 2 sees both drafts
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1],
        ]
    )
    assert np.array_equal(mask[0, 0], want)


def test_decode_step_mask_one_group_after_its_drafts():
    """Lossless without draft groups: the masks see exactly the valid drafts, so the block is
    causal over its valid tokens; row 1's second draft is padding and nobody sees it."""
    mask = decode_step_mask(
        bools([[1], [1]]),
        bools([[1, 1, 1], [1, 1, 0]]),
        group_sees=np.array([[3], [2]]),
        group_valid=bools([[1], [1]]),
        n_masks=2,
    )
    #               cache p  d0 d1 m0 m1
    row1 = bools(
        [
            [1, 1, 0, 0, 0, 0],  # pending
            [1, 1, 1, 0, 0, 0],  # draft 0
            [1, 1, 1, 1, 0, 0],  # padding draft: itself only extra
            [1, 1, 1, 0, 1, 0],  # masks skip the padding draft
            [1, 1, 1, 0, 1, 1],
        ]
    )
    assert np.array_equal(mask[0, 0], np.tri(5, 6, 1, dtype=bool))
    assert np.array_equal(mask[1, 0], row1)


def test_decode_step_mask_plain_causal_can_be_left_to_the_model():
    full = threshold_step_mask(bools([[1, 1]]), bools([[1, 1]]), n_masks=2)
    assert np.array_equal(full[0, 0], np.tri(4, 6, 2, dtype=bool))
    args = dict(group_valid=bools([[1]]), n_masks=2, causal_as_none=True)
    two = np.array([[2]])
    assert decode_step_mask(bools([[1, 1]]), bools([[1, 1]]), group_sees=two, **args) is None
    # a hole in the cache, or a padding column, needs the explicit mask
    assert decode_step_mask(bools([[1, 0]]), bools([[1, 1]]), group_sees=two, **args) is not None
    assert decode_step_mask(bools([[1, 1]]), bools([[1, 0]]), group_sees=np.array([[1]]), **args) is not None


# ------------------------------------------------------------------ for_attention


def test_for_attention_sdpa_keeps_bool(make_tiny_model):
    model = make_tiny_model("qwen2", "sdpa")
    mask = two_stream_mask(6, 2)[None, None]
    out = for_attention(mask, model)
    assert out.dtype == torch.bool
    assert torch.equal(out, mask)


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_for_attention_eager_is_additive(make_tiny_model, dtype):
    model = make_tiny_model("qwen2", "eager")
    mask = two_stream_mask(6, 2)[None, None]
    out = for_attention(mask, model, dtype=dtype)
    want = dtype or model.dtype
    assert out.dtype == want and out.is_floating_point()
    assert out.shape == mask.shape
    assert (out[mask] == 0).all()
    assert (out[~mask] == torch.finfo(want).min).all()


def test_for_attention_refuses_flash(make_tiny_model):
    model = make_tiny_model("qwen2", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="sdpa"):
        for_attention(two_stream_mask(4, 2)[None, None], model)
