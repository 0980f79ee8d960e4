"""The rules of one decoding step, as plain functions over per-row host arrays (batch.py runs them).

A decoding mode is two entries: its facts in ``params.MODE_SPECS`` (whether it drafts, reads tau,
samples) and its rule here, in ``ACCEPTANCE``: what a row in it accepts from a step's outputs
(:class:`StepOutputs`), and what it tried and used there (adaptive width reads that). The batch
runs each rule over the rows of its mode and joins the results (:func:`accept_by_mode`).

Threshold rows accept a confident left-to-right prefix of ``[AR token, mask predictions]``
(acceptance.py holds the confidence rule). Lossless rows keep the drafts the AR outputs confirm,
then the AR token after them, and draft their next step from the masks. Hybrid rows do what
lossless rows do, then apply the threshold rule to the mask group verification selected (the one
that saw exactly the kept drafts): its confident left-to-right prefix is accepted after the AR
token, and the rest of the group is the next draft (the paper's section 4.6, the model drafting
for itself). At tau 1 the threshold part accepts nothing, so hybrid is lossless token for token;
below, a step accepts what lossless would, and more.

Adaptive width (``adaptive_width``, on by default; ``PAPER_RULE`` turns it off and lifts the batch
limit below, so that every step reads its masks, as the paper's sampler does): a row whose masks
were all refused in ``REST_AFTER`` steps running rests: it reads no masks for 1 step, then, after
each further refused try, for 2, 4, 8 and at most 16 steps; one accepted mask ends the streak. A
resting row decodes one token per step at the cost of a plain AR step, so off the training
distribution, where masks are rarely confident, MARS costs about what AR does. The policy is all or
nothing on purpose: where a forward is overhead-bound, the first mask a step feeds costs far more
than the next ones, so narrowing a step saves little and loses reach. Under causal attention a mask
never sees the masks after it, so resting changes no mask's prediction; it does change the output
at tau < 1: where a resting row emits the AR token alone, the paper's sampler could have accepted
mask predictions after it, and the two then continue from different prefixes.

Batch limit (``mask_batch_limit``; by default ``"auto"``, set each step from measured costs by
costs.py): while more rows run than this, no row reads masks, and every row decodes one token per
step, as AR. Where a forward is compute-bound a mask costs about what a token does, so masks can
make a step slower than they make it productive; vLLM's speculative decoding has the same switch
(``disable_by_batch_size``). ``marslm bench --cost-curve`` tells where it pays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .acceptance import accept_length
from .params import one_token_rows
from .rows import RowState, mode_names

REST_AFTER = 2  # adaptive width: refused steps running before a row rests from masks
MAX_PAUSE_DOUBLINGS = 4  # and it rests at most 2**4 = 16 steps between tries


def masks_to_read(rows: RowState, mask_batch_limit: int | None) -> np.ndarray:
    """``[rows]`` masks each row reads this step: none above the batch limit, none for a resting
    row or a threshold row in one-token mode (a batch of only those is plain AR), else its most."""
    if mask_batch_limit is not None and len(rows) > mask_batch_limit:
        return np.zeros(len(rows), np.int64)
    plain = ~rows.drafting & rows.reads_tau & one_token_rows(rows.tau, rows.metric)
    return np.where(~plain & (rows.pause == 0), rows.max_masks, 0)


def threshold_accept(predicted, conf, rows: RowState, masks_read, first_mask: int, masks_per_group: int):
    """``[AR token, first group's masks]`` and how many of them each row accepts.

    ``predicted``/``conf``: ``[rows, read columns]``, column 0 the AR output at the last pending
    token, ``first_mask`` the column of the first mask's output.
    """
    if masks_per_group == 0:  # the AR token alone, always accepted
        return predicted[:, :1].copy(), np.ones(len(rows), np.int64)
    columns = np.concatenate([[0], np.arange(first_mask, first_mask + masks_per_group)])
    return predicted[:, columns], accept_length(conf[:, columns], rows.tau, rows.metric, masks_read + 1)


def verify_drafts(ar_tokens, draft, draft_valid):
    """Greedy verification: how many leading drafts equal the AR output before them, and the AR
    token after the last one kept. ``ar_tokens``: ``[rows, K + 1]``; ``draft``: ``[rows, K]``."""
    matches = (ar_tokens[:, : draft.shape[1]] == draft) & draft_valid
    verified = np.cumprod(matches, axis=1).sum(axis=1)
    return verified, ar_tokens[np.arange(len(draft)), verified]


def lossless_candidates(draft, verified, correction, width: int):
    """The kept drafts, then the token after them, in ``width`` columns."""
    return np.where(np.arange(width) == verified[:, None], correction[:, None], pad_cols(draft, width))


def selected_group(rows: RowState, verified, groups: int, *, draft_groups: bool):
    """Per drafting row, the mask group that saw exactly the drafts verification kept, and whether
    there is one: with draft groups group j saw j drafts; without, the one group saw the whole draft,
    so it counts only when every draft was kept. Returns ``(group, usable)``."""
    if draft_groups:
        return np.minimum(verified, groups - 1), rows.drafting
    return np.zeros_like(verified), rows.drafting & (verified == rows.draft_len)


def hybrid_accept(candidates, verified, group_tokens, group_conf, usable, tau, metric, masks_read):
    """Hybrid rows: the kept drafts and the AR token after them (``candidates``, as lossless builds
    them), then the selected group's confident left-to-right prefix under the row's tau and metric.

    The threshold rule is acceptance.py's, with the AR token as its always-accepted first candidate,
    so tau 1 accepts no mask and a row accepts at least ``verified + 1``. ``group_tokens`` and
    ``group_conf``: ``[rows, masks per group]`` of the selected group; ``candidates`` must have room
    for ``verified + 1`` and the group. Returns ``(candidates, accept)``.
    """
    per_group = group_tokens.shape[1]
    ar_first = np.concatenate([np.zeros_like(group_conf[:, :1]), group_conf], axis=1)
    taken = np.where(usable, accept_length(ar_first, tau, metric, masks_read + 1) - 1, 0)
    at = np.arange(candidates.shape[1]) - (verified + 1)[:, None]
    masks = np.take_along_axis(group_tokens, np.clip(at, 0, per_group - 1), axis=1)
    in_group = (at >= 0) & (at < per_group) & usable[:, None]
    return np.where(in_group, masks, candidates), verified + 1 + taken


@dataclass
class StepOutputs:
    """A step's read columns on the host, for the modes' rules: each reads what it needs."""

    rows: RowState
    predicted: (
        np.ndarray
    )  # [rows, read columns] top-1 ids: the AR output at the last pending token, the drafts', the masks'
    conf: np.ndarray | None  # their confidences under each row's metric (None: only the AR column was read)
    probs: object  # [rows, read columns, vocab] sampling probabilities (torch) where a row samples, else None
    masks_read: np.ndarray  # [rows] masks each row read
    mask_tokens: np.ndarray  # [rows, groups, masks per group] the masks' top-1 ids
    verified: np.ndarray  # [rows] drafting rows: the drafts the AR outputs confirmed (0 for the others)
    checked: np.ndarray | None  # [rows, K + 1] drafting rows: the kept drafts, then the AR token after them
    draft_groups: bool
    draw: Callable  # draw(probs, selected, positions) -> one token per selected entry (draws.py)

    @property
    def first_mask(self) -> int:
        """The column of the first mask's output: after the AR token's and the drafts'."""
        return self.rows.draft.shape[1] + 1

    @property
    def mask_conf(self) -> np.ndarray:
        return self.conf[:, self.first_mask :].reshape(self.mask_tokens.shape)


def threshold_rule(out: StepOutputs, rows_of):
    """The confidence rule; a sampling row draws its AR token and its masks keep the rule."""
    r = out.rows
    tokens, accept = threshold_accept(
        out.predicted, out.conf, r, out.masks_read, out.first_mask, out.mask_tokens.shape[2]
    )
    sampling = (r.temperature > 0) & rows_of
    if out.probs is not None and sampling.any():
        tokens[:, 0] = np.where(sampling, out.draw(out.probs[:, 0], sampling, r.seq_len), tokens[:, 0])
    return tokens, accept


def lossless_rule(out: StepOutputs, rows_of):
    """The drafts the AR outputs confirmed, then the AR token after them."""
    return out.checked, out.verified + 1


def hybrid_rule(out: StepOutputs, rows_of):
    """As lossless, then the threshold rule on the group verification selected."""
    if not out.mask_tokens.shape[2]:  # a step that read no masks: lossless
        return lossless_rule(out, rows_of)
    r, rows = out.rows, np.arange(len(out.rows))
    group, usable = selected_group(r, out.verified, out.mask_tokens.shape[1], draft_groups=out.draft_groups)
    width = r.draft.shape[1] + out.mask_tokens.shape[2] + 1  # the kept drafts, the AR token, a whole group
    return hybrid_accept(
        pad_cols(out.checked, width),
        out.verified,
        out.mask_tokens[rows, group],
        out.mask_conf[rows, group],
        usable & rows_of,
        r.tau,
        r.metric,
        out.masks_read,
    )


def threshold_tries(out: StepOutputs, accept):
    """A threshold row tried its masks and used what it accepted past its AR token."""
    return out.masks_read, accept - 1


def lossless_tries(out: StepOutputs, accept):
    """A lossless row tried its drafts and used those verification kept."""
    return out.rows.draft_len, out.verified


def hybrid_tries(out: StepOutputs, accept):
    """A hybrid row tried its drafts and its masks, except at tau 1, where the threshold part
    accepts nothing and it rests exactly as a lossless row would."""
    r = out.rows
    return np.where(one_token_rows(r.tau, r.metric), 0, out.masks_read) + r.draft_len, accept - 1


@dataclass(frozen=True)
class Rule:
    accept: Callable  # (StepOutputs, the mode's rows) -> (candidates [rows, any width], accept lengths)
    tries: Callable  # (StepOutputs, accept lengths) -> (tried, used): adaptive width's inputs


ACCEPTANCE = {
    "threshold": Rule(threshold_rule, threshold_tries),
    "lossless": Rule(lossless_rule, lossless_tries),
    "hybrid": Rule(hybrid_rule, hybrid_tries),
}


def accept_by_mode(out: StepOutputs, width: int):
    """Each row's candidates (``width`` columns) and accept length, by its mode's rule."""

    def accept(rule: Rule, rows_of):
        tokens, length = rule.accept(out, rows_of)
        return pad_cols(tokens, width)[:, :width], length

    return _by_mode(out.rows, accept)


def tries(out: StepOutputs, accept):
    """Adaptive width's ``(tried, used)`` per row this step, by its mode's rule: what the row could
    have accepted past its AR token, and how much of it it did."""
    return _by_mode(out.rows, lambda rule, rows_of: rule.tries(out, accept))


def _by_mode(rows: RowState, run):
    """``run(rule, rows_of)``'s arrays (each ``[rows, ...]``), every row's taken from its own mode's
    rule; a rule runs only where a row uses its mode, and one mode's arrays need no joining."""
    names, codes = mode_names(), np.unique(rows.mode)
    joined = None
    for code in codes:
        rows_of = rows.mode == code if len(codes) > 1 else np.ones(len(rows), bool)
        arrays = run(ACCEPTANCE[names[code]], rows_of)
        if joined is None:  # every row's, until its own mode's overwrite it
            joined = arrays
        else:
            joined = tuple(np.where(rows_of.reshape(-1, *[1] * (a.ndim - 1)), a, j) for a, j in zip(arrays, joined))
    return joined


def cut_at_stop(candidates, accept, stop_ids):
    """Accept lengths that end at the first stop token accepted, and which rows stopped."""
    is_stop = (candidates[:, :, None] == stop_ids).any(axis=2) & (np.arange(candidates.shape[1]) < accept[:, None])
    stopped = is_stop.any(axis=1)
    return np.where(stopped, is_stop.argmax(axis=1) + 1, accept), stopped


def back_off(misses, pause, tried, used):
    """Adaptive width: count each row's steps running whose masks (lossless: drafts) were all
    refused; from ``REST_AFTER`` of them on, the row rests, twice as long after each miss.

    ``tried``: masks (drafts) each row had this step; ``used``: how many of them it accepted.
    Returns the new ``(misses, pause)``.
    """
    missed = (tried > 0) & (used == 0)
    misses = np.where(tried > 0, np.where(missed, misses + 1, 0), misses)
    backoff = 2 ** np.minimum(np.maximum(misses - REST_AFTER, 0), MAX_PAUSE_DOUBLINGS)
    return misses, np.where(missed & (misses >= REST_AFTER), backoff, np.maximum(pause - 1, 0))


def next_draft(rows: RowState, mask_tokens, verified, masks_read, probs, *, draft_groups: bool, draw, taken=None):
    """Drafting rows' drafts for the next step, from the masks of the group that saw exactly the
    drafts that were accepted (:func:`selected_group`): ``(draft, draft_len)``.

    ``taken``: ``[rows]`` masks of that group a hybrid row accepted after its AR token; its draft
    is the rest of the group. Sampling rows draw their drafts from the masks' distributions, each
    at the position it drafts (``draw(probs, selected, positions)``, draws.py: with the noise the
    next step's verification races that position with). Call it once the step's accepted tokens
    are recorded (``rows.seq_len`` is where the draft starts).
    """
    n, groups, per_group = mask_tokens.shape
    if not rows.drafting.any():  # threshold rows never draft
        if rows.draft.shape[1]:
            return np.zeros((n, 0), np.int64), np.zeros(n, np.int64)
        return rows.draft, rows.draft_len
    group, usable = selected_group(rows, verified, groups, draft_groups=draft_groups)
    chosen = mask_tokens[np.arange(n), group]
    taken = np.zeros(n, np.int64) if taken is None else np.where(usable, taken, 0)
    if taken.any():  # a hybrid row's draft starts after the masks it accepted
        chosen = np.take_along_axis(chosen, np.minimum(np.arange(per_group) + taken[:, None], per_group - 1), axis=1)
    draft_len = np.where(usable, masks_read - taken, 0)
    sampling = rows.drafting & (rows.temperature > 0)
    if probs is not None and sampling.any():
        vocab = probs.shape[-1]
        mask_probs = probs[:, rows.draft.shape[1] + 1 :].reshape(n, groups, per_group, vocab)
        at = torch.from_numpy(group).to(probs.device)[:, None, None, None].expand(-1, 1, per_group, vocab)
        q = mask_probs.gather(1, at)[:, 0]
        wanted = sampling[:, None] & (np.arange(per_group) < draft_len[:, None])
        positions = rows.seq_len[:, None] + np.arange(per_group)
        drawn = draw(q.reshape(n * per_group, vocab), wanted.reshape(-1), positions.reshape(-1))
        chosen = np.where(sampling[:, None], drawn.reshape(n, per_group), chosen)
    # only as wide as the longest usable draft: a column no row drafts would be fed as padding
    return chosen[:, : int(draft_len.max())], draft_len


def compaction_order(slot_valid, cached_len) -> np.ndarray | None:
    """Where each row's valid cache slots are, first to last, once holes (padding slots of rows that
    fed fewer tokens than the widest row) are more than half of the cache; else None. Keys carry
    their rotary positions with them, so slot order does not matter to attention."""
    widest = int(cached_len.max())  # a row's valid slots are its cached tokens
    if slot_valid.shape[1] <= 2 * widest + 8:
        return None
    return np.ascontiguousarray(np.argsort(~slot_valid, axis=1, kind="stable")[:, :widest])


def pad_cols(t: np.ndarray, width: int) -> np.ndarray:
    """Right-pad (or keep) ``t`` to at least ``width`` columns with zeros."""
    if t.shape[1] >= width:
        return t
    return np.concatenate([t, np.zeros((len(t), width - t.shape[1]), t.dtype)], axis=1)
