"""Phase 1 of a decoding step: what every row feeds, at which positions, what each fed token
sees, and which outputs are read, all built on the host from the rows' state (rows.py).

A step feeds ``[real | groups x masks]`` per row, padded to the widest row:

    real     the row's tokens whose keys/values are not cached yet (at least its last token), then,
             for lossless and hybrid rows, last step's mask predictions as drafts to verify: one
             run of consecutive positions, so a row that accepted more last step and drafts less
             now is no wider than one that did the opposite
    masks    one group of masks; with draft groups, one group per possible number of accepted
             drafts, each seeing only that many drafts (the paper's section 4.6)

and reads the outputs at the last token not cached (the AR token), at each draft, and at every mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..masks import causal_step_mask, decode_step_mask
from .rows import RowState


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [rows, fed]
    position_ids: np.ndarray  # [rows, fed]
    mask: np.ndarray | None  # what each fed token sees (None: plain causal)
    read_cols: np.ndarray  # [rows, read] fed columns whose outputs the step reads
    # what the phases after the forward need
    real_valid: np.ndarray  # [rows, real width]: the fed tokens that are not masks or padding
    pending_len: np.ndarray  # [rows] of them, those that are not drafts
    draft_valid: np.ndarray  # [rows, K]
    masks_read: np.ndarray  # [rows] masks each row reads
    masks_per_group: int  # masks fed per group: the most any row reads
    groups: int

    @property
    def mask_offsets(self) -> np.ndarray:
        """``[masks]``: each mask column's offset inside its group. The masks are every row's last
        columns, after the real ones: where exact mode's adapter acts (``MaskAdapter.tail_gate``);
        padding and real tokens are never masks, whatever their id."""
        return np.tile(np.arange(self.masks_per_group), self.groups)


def step_inputs(
    rows: RowState,
    masks_read: np.ndarray,
    *,
    draft_groups: bool,
    pad_id: int,
    mask_token_id: int,
    causal_as_none: bool = True,
) -> StepInputs:
    """``causal_as_none``: a mask that is plain causal attention is None (the model's own); a
    compiled step takes one layout, always a tensor."""
    n, index = len(rows), np.arange(len(rows))[:, None]
    pending_len = rows.seq_len - rows.cached_len
    real_len = pending_len + rows.draft_len
    width_real, per_group, draft_width = int(real_len.max()), int(masks_read.max()), rows.draft.shape[1]
    groups = draft_width + 1 if draft_groups else 1

    real_cols, draft_cols, mask_cols = np.arange(width_real), np.arange(draft_width), np.arange(per_group)
    real_valid = real_cols < real_len[:, None]
    real = rows.tokens[index, np.minimum(rows.cached_len[:, None] + real_cols, rows.tokens.shape[1] - 1)]
    if draft_width:
        in_draft = real_cols - pending_len[:, None]
        real = np.where(in_draft >= 0, rows.draft[index, np.clip(in_draft, 0, draft_width - 1)], real)
    draft_valid = draft_cols < rows.draft_len[:, None]
    if draft_groups:  # group j sees j drafts
        group_drafts = np.broadcast_to(np.arange(groups), (n, groups))
        group_valid = group_drafts <= rows.draft_len[:, None]
    else:
        group_drafts, group_valid = rows.draft_len[:, None], np.ones((n, 1), bool)
    input_ids = np.concatenate(
        [np.where(real_valid, real, pad_id), np.full((n, groups * per_group), mask_token_id)], axis=1
    )
    position_ids = np.concatenate(
        [
            rows.cached_len[:, None] + real_cols,
            (rows.seq_len[:, None, None] + group_drafts[:, :, None] + mask_cols).reshape(n, -1),
        ],
        axis=1,
    )
    group_sees = pending_len[:, None] + group_drafts
    mask = decode_step_mask(rows.slot_valid, real_valid, group_sees, group_valid, per_group, causal_as_none)
    read_cols = np.concatenate(
        [
            (pending_len - 1)[:, None],
            # a padding draft's column is any fed one: its output is never used
            np.minimum(pending_len[:, None] + draft_cols, width_real - 1),
            np.broadcast_to(width_real + np.arange(groups * per_group), (n, groups * per_group)),
        ],
        axis=1,
    )
    return StepInputs(
        input_ids, position_ids, mask, read_cols, real_valid, pending_len, draft_valid, masks_read, per_group, groups
    )


def logits_to_keep(read_cols: np.ndarray, width: int) -> int | np.ndarray:
    """The model's ``logits_to_keep`` for a step that reads ``read_cols`` of ``width`` fed columns:
    how many they are where every row reads its last ones (the model slices them, as in HF
    ``generate``: the common case, and always at batch size 1), else the columns themselves."""
    n = read_cols.shape[1]
    if np.array_equal(read_cols, np.broadcast_to(np.arange(width - n, width), read_cols.shape)):
        return n
    return read_cols


def prefill_inputs(rows: RowState, joining: np.ndarray, pad_id: int):
    """The prompts of the rows ``joining``, less their last token (it stays pending, so a joining
    row's first step is like any other): ``(input_ids, position_ids, mask, valid)``."""
    lengths = rows.prompt_len[joining] - 1
    width = int(lengths.max())
    valid = np.arange(width) < lengths[:, None]
    input_ids = np.where(valid, rows.tokens[joining, :width], pad_id)
    positions = np.repeat(np.arange(width)[None], len(joining), axis=0)
    return input_ids, positions, causal_step_mask(np.zeros((len(joining), 0), bool), valid), valid
