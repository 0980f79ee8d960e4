"""Phase 1 of a decoding step: what every row feeds, at which positions, what each fed token
sees, and which outputs are read, all built on the host from the rows' state (rows.py).

A step feeds ``[pending | draft | groups x masks]`` per row, padded to the widest row:

    pending  the row's tokens whose keys/values are not cached yet (at least its last token)
    draft    lossless and hybrid rows: last step's mask predictions, to verify
    masks    one group of masks; with draft groups, one group per possible number of accepted
             drafts, each seeing only that many drafts (the paper's section 4.6)

and reads the outputs at the last pending token (the AR token), at each draft, and at every mask.
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
    pending_valid: np.ndarray  # [rows, pending width]
    draft_valid: np.ndarray  # [rows, K]
    masks_read: np.ndarray  # [rows] masks each row reads
    masks_per_group: int  # masks fed per group: the most any row reads
    groups: int


def step_inputs(
    rows: RowState, masks_read: np.ndarray, *, draft_groups: bool, pad_id: int, mask_token_id: int
) -> StepInputs:
    n = len(rows)
    pending_len = rows.seq_len - rows.cached_len
    width_pending, per_group, draft_width = int(pending_len.max()), int(masks_read.max()), rows.draft.shape[1]
    groups = draft_width + 1 if draft_groups else 1

    cols = np.arange(max(width_pending, draft_width, per_group))
    pending_cols, draft_cols, mask_cols = cols[:width_pending], cols[:draft_width], cols[:per_group]
    pending_valid = pending_cols < pending_len[:, None]
    at = np.minimum(rows.cached_len[:, None] + pending_cols, rows.tokens.shape[1] - 1)
    pending = np.where(pending_valid, rows.tokens[np.arange(n)[:, None], at], pad_id)
    draft_valid = draft_cols < rows.draft_len[:, None]
    if draft_groups:
        group_sees = np.broadcast_to(np.arange(groups), (n, groups))
        group_valid = group_sees <= rows.draft_len[:, None]
    else:
        group_sees, group_valid = rows.draft_len[:, None], np.ones((n, 1), bool)
    input_ids = np.concatenate(
        [pending, np.where(draft_valid, rows.draft, pad_id), np.full((n, groups * per_group), mask_token_id)],
        axis=1,
    )
    position_ids = np.concatenate(
        [
            rows.cached_len[:, None] + pending_cols,
            rows.seq_len[:, None] + draft_cols,
            (rows.seq_len[:, None, None] + group_sees[:, :, None] + mask_cols).reshape(n, -1),
        ],
        axis=1,
    )
    mask = decode_step_mask(
        rows.slot_valid, pending_valid, draft_valid, group_sees, group_valid, per_group, causal_as_none=True
    )
    read_cols = np.concatenate(
        [
            (pending_len - 1)[:, None],
            (width_pending + draft_cols)[None].repeat(n, axis=0),
            (width_pending + draft_width + np.arange(groups * per_group))[None].repeat(n, axis=0),
        ],
        axis=1,
    )
    return StepInputs(
        input_ids, position_ids, mask, read_cols, pending_valid, draft_valid, masks_read, per_group, groups
    )


def prefill_inputs(rows: RowState, joining: np.ndarray, pad_id: int):
    """The prompts of the rows ``joining``, less their last token (it stays pending, so a joining
    row's first step is like any other): ``(input_ids, position_ids, mask, valid)``."""
    lengths = rows.prompt_len[joining] - 1
    width = int(lengths.max())
    valid = np.arange(width) < lengths[:, None]
    input_ids = np.where(valid, rows.tokens[joining, :width], pad_id)
    positions = np.repeat(np.arange(width)[None], len(joining), axis=0)
    return input_ids, positions, causal_step_mask(np.zeros((len(joining), 0), bool), valid), valid
