"""The MARS training objective: a two-stream batch and its loss (docs/method.md).

    z          = [x ; x~]                x~: response tokens replaced by <|mask|>
    positions  = [0..L-1 ; 0..L-1]
    mask       = masks.two_stream_mask(L, B)
    loss       = CE(noisy logits at t-1, x_t) + ar_weight * CE(clean logits at t-1, x_t)

over response targets t. The clean half is exactly an AR forward of x (it never sees the noisy
half), so ``ar_weight`` keeps the plain SFT loss in the objective: that is what keeps one-token
quality at or above the AR baseline as B grows.

That is the objective as written. The batch built here computes the same loss with fewer tokens:
x~ keeps only the columns some loss term depends on (from the block that holds the output
predicting the first target, to the last target), so a long prompt is not run through the model
twice (``needed_noisy_columns``; a test checks loss and gradients against the literal form above).

The loss reads the outputs at target columns only: ``head_loss.target_loss`` runs the output
projection there alone, fused with the cross-entropy and chunked, so no ``[columns, vocabulary]``
logits exist (``target_logits=False`` keeps the model's own full logits, for inspection).

Rows come from collate.py, padded or packed; a packed row's sequences keep to themselves, so its
loss is the padded batch's without the padding's FLOPs. :class:`Masking` chooses how the masked
stream covers the data (phases, copies, offset weights); exact mode's loss (exact.py) is the
masked term alone, over the clean stream as a cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..adapter import placed_masks
from ..chat import IGNORE
from ..masks import packed_two_stream_mask, split_attention, training_mask
from .head_loss import SparseTargets, cross_entropy, has_linear_head, target_loss


@dataclass
class TwoStreamBatch:
    input_ids: torch.Tensor  # [rows, T + N]: each row's clean tokens, then its noisy copies
    position_ids: torch.Tensor  # [rows, T + N]
    segment_ids: torch.Tensor  # [rows, T + N] the sequence of the row each column belongs to; -1 padding
    streams: torch.Tensor  # [rows, T + N] 0 for the clean stream, s >= 1 for the s-th noisy copy
    phases: torch.Tensor  # [rows, T + N] the block phase of each noisy column's copy (0 on the clean stream)
    block_size: int
    labels: torch.Tensor  # [rows, T] clean-stream targets, IGNORE where no loss
    noisy_labels: torch.Tensor  # [rows, N] noisy-stream targets (the same targets, in the noisy columns)
    noisy_columns: torch.Tensor  # [rows, N] the clean column each noisy column copies; -1 for padding

    @property
    def is_noisy(self) -> torch.Tensor:
        return self.streams > 0

    @property
    def placed_masks(self) -> torch.Tensor:
        """``[rows, T + N]``: where this batch put the mask token (each noisy column with a target,
        and the noisy padding): the columns exact mode's adapter acts at (adapter.placed_masks)."""
        noisy = (self.noisy_columns < 0) | (self.noisy_labels != IGNORE)
        return torch.cat([torch.zeros_like(self.labels, dtype=torch.bool), noisy], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[rows, 1, T + N, T + N]`` bool, True where a query may attend."""
        return packed_two_stream_mask(self.position_ids, self.segment_ids, self.streams, self.block_size, self.phases)

    def mask_for(self, model, first_query: int = 0):
        """The mask as the model's attention back-end takes it (masks.training_mask), for the
        queries from column ``first_query`` on."""
        return training_mask(
            self.position_ids, self.segment_ids, self.streams, self.block_size, model, self.phases, first_query
        )

    def mask_offsets(self) -> torch.Tensor:
        """``[rows, N]``: how many masks of its own block each noisy mask attends to before itself (its
        offset: the i-th mask of a block predicts the token i + 2 places past the last real token it
        sees, as the i-th mask after a prefix does in decoding); 0 at the other noisy columns.

        A block's masks are consecutive kept columns of one copy and one sequence, so this is a
        running count that restarts at each (copy, sequence, block).
        """
        width = self.labels.shape[1]
        is_mask = self.noisy_labels != IGNORE
        blk = (self.position_ids[:, width:] + self.phases[:, width:]) // self.block_size
        group = torch.stack([self.streams[:, width:], self.segment_ids[:, width:], blk], dim=-1)
        starts = torch.ones_like(is_mask)
        starts[:, 1:] = (group[:, 1:] != group[:, :-1]).any(-1)
        seen = is_mask.long().cumsum(1)
        columns = torch.arange(is_mask.shape[1], device=is_mask.device).expand_as(is_mask)
        group_start = torch.where(starts, columns, 0).cummax(dim=1).values
        before_group = (seen - is_mask.long()).gather(1, group_start)
        return torch.where(is_mask, seen - before_group - 1, 0)


def needed_noisy_columns(
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    block_size: int,
    phases: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[rows, T]`` bool: the columns whose noisy copy some loss term depends on.

    A sequence's noisy outputs are scored from the column before its first target through its last
    target (whose label the shifted loss reads from the next column). A noisy query sees noisy keys
    only inside its own block, so the copy must start at the first scored column's block and may
    stop at the last target. Everything else in the noisy half (the prompt before that block, the
    padding after the end) is attended by no scored query: leaving it out changes no loss and no
    gradient, and saves about a quarter of the tokens of a two-stream batch on the toy suite.
    ``phases`` ``[rows, T]``: the copy's block phase at each column (None: 0).
    """
    target = labels != IGNORE
    scored = torch.zeros_like(target)
    scored[:, :-1] = target[:, 1:] & (segment_ids[:, 1:] == segment_ids[:, :-1])
    blk = (position_ids if phases is None else position_ids + phases) // block_size
    seg = segment_ids.clamp(min=0)  # padding (-1) has no targets; masked out below
    n_seg = int(seg.max()) + 1
    none = torch.iinfo(torch.long).max
    first_blk = torch.full((len(seg), n_seg), none, dtype=torch.long, device=seg.device).scatter_reduce(
        1, seg, torch.where(scored, blk, none), "amin"
    )
    last_target = torch.full((len(seg), n_seg), -1, dtype=torch.long, device=seg.device).scatter_reduce(
        1, seg, torch.where(target, position_ids, -1), "amax"
    )
    return (segment_ids >= 0) & (blk >= first_blk.gather(1, seg)) & (position_ids <= last_target.gather(1, seg))


def draw_phases(
    segment_ids: torch.Tensor | None, rows: int, block_size: int, streams: int, random_phase: bool
) -> torch.Tensor:
    """``[rows, sequences, streams]``: the block phase of each noisy copy of each sequence.

    Copies of one sequence take distinct phases (while there are B of them), so B copies put every
    token at every offset of a block in one pass. ``random_phase`` draws them per sequence (a
    different offset for each token at each epoch); else copy s has phase s - 1.
    """
    sequences = 1 if segment_ids is None else int(segment_ids.max()) + 1
    device = None if segment_ids is None else segment_ids.device
    order = torch.arange(streams, device=device) % block_size
    if not random_phase:
        return order.expand(rows, sequences, streams).clone()
    shuffled = torch.rand(rows, sequences, block_size, device=device).argsort(dim=-1)
    return shuffled.gather(-1, order.expand(rows, sequences, streams))


def two_stream_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    phases: torch.Tensor | None = None,
) -> TwoStreamBatch:
    """``[x ; x~_1 ; ... ; x~_S]`` per row, each x~ cut down to the columns the loss needs
    (needed_noisy_columns). ``phases`` ``[rows, sequences, S]`` (:func:`draw_phases`): one noisy
    copy per phase; None is one copy at phase 0, the paper's batch.

    A padded batch is the packed case with one sequence per row (its right padding is harmless:
    real tokens never attend later columns, and no target lies there).
    """
    rows, width = input_ids.shape
    if segment_ids is None:
        position_ids = torch.arange(width, device=input_ids.device).expand(rows, -1)
        segment_ids = torch.zeros_like(input_ids)
    if phases is None:
        phases = draw_phases(segment_ids, rows, block_size, 1, random_phase=False)
    noisy_ids = torch.where(labels != IGNORE, torch.full_like(input_ids, mask_token_id), input_ids)
    sequence_phase = segment_ids.clamp(min=0)[:, :, None].expand(-1, -1, phases.shape[2])
    column_phases = phases.gather(1, sequence_phase)  # [rows, T, S]
    copies = [
        _noisy_copy(noisy_ids, labels, position_ids, segment_ids, column_phases[:, :, s], block_size, mask_token_id)
        for s in range(phases.shape[2])
    ]
    streams = [torch.zeros_like(input_ids)] + [torch.full_like(c["ids"], s + 1) for s, c in enumerate(copies)]
    return TwoStreamBatch(
        input_ids=torch.cat([input_ids] + [c["ids"] for c in copies], dim=1),
        position_ids=torch.cat([position_ids] + [c["positions"] for c in copies], dim=1),
        segment_ids=torch.cat([segment_ids] + [c["segments"] for c in copies], dim=1),
        streams=torch.cat(streams, dim=1),
        phases=torch.cat([torch.zeros_like(input_ids)] + [c["phases"] for c in copies], dim=1),
        block_size=block_size,
        labels=labels,
        noisy_labels=torch.cat([c["labels"] for c in copies], dim=1),
        noisy_columns=torch.cat([c["columns"] for c in copies], dim=1),
    )


def _noisy_copy(noisy_ids, labels, position_ids, segment_ids, phases, block_size: int, mask_token_id: int) -> dict:
    """One noisy copy at the given per-column phases, its kept columns first in their order; a row
    with fewer is padded (segment -1, no targets)."""
    keep = needed_noisy_columns(labels, position_ids, segment_ids, block_size, phases)
    counts = keep.sum(dim=1)
    columns = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, : int(counts.max())]
    real = torch.arange(columns.shape[1], device=labels.device) < counts[:, None]
    return {
        "ids": torch.where(real, noisy_ids.gather(1, columns), mask_token_id),
        "positions": torch.where(real, position_ids.gather(1, columns), 0),
        "segments": torch.where(real, segment_ids.gather(1, columns), -1),
        "phases": torch.where(real, phases.gather(1, columns), 0),
        "labels": torch.where(real, labels.gather(1, columns), IGNORE),
        "columns": torch.where(real, columns, -1),
    }


# t ~ U(T_MIN, 1) for the inverse-t weighting, as the reference's masked-diffusion trainer draws it
T_MIN = 1e-3


def target_weights(labels: torch.Tensor, segment_ids: torch.Tensor | None, normalization: str) -> torch.Tensor:
    """``[rows, T]``: each target's share of its batch's loss, before dividing by :func:`normalizer`.

    A target is a label the shifted loss reads (columns 1..T-1, not IGNORE). ``token``: every target
    weighs 1, the loss is the mean over all targets. ``sequence`` (the reference's): a target weighs
    1 / (targets in its sequence), the loss is the mean over sequences of each one's mean.
    """
    target = torch.zeros_like(labels, dtype=torch.bool)
    target[:, 1:] = labels[:, 1:] != IGNORE
    weights = target.to(torch.float32)
    if normalization == "token":
        return weights
    seq = _sequence_index(labels, segment_ids)
    counts = torch.zeros(int(seq.max()) + 1, device=labels.device).scatter_add_(0, seq.flatten(), weights.flatten())
    return weights / counts[seq].clamp(min=1)


def normalizer(labels: torch.Tensor, segment_ids: torch.Tensor | None, normalization: str) -> int:
    """What a batch's summed weighted losses are divided by: its targets, or its sequences with a target."""
    weights = target_weights(labels, segment_ids, normalization)
    return int(round(float(weights.sum())))


def _sequence_index(labels: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """``[rows, T]`` a batch-wide index of the sequence each column belongs to (padding shares one)."""
    rows, width = labels.shape
    if segment_ids is None:
        return torch.arange(rows, device=labels.device)[:, None].expand(rows, width)
    per_row = int(segment_ids.max()) + 2  # segments 0.. plus padding (-1)
    return torch.arange(rows, device=labels.device)[:, None] * per_row + segment_ids + 1


def inverse_t_factors(labels: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """``[rows, T]``: one 1/t per sequence, t ~ U(1e-3, 1), the reference's weighting of the masked-stream
    loss when the SFT term is off (``MARSTrainerNoSFT``: a linear-schedule masked-diffusion weight)."""
    seq = _sequence_index(labels, segment_ids)
    t = T_MIN + (1 - T_MIN) * torch.rand(int(seq.max()) + 1, device=labels.device)
    return 1.0 / t[seq]


def _targets_at(labels: torch.Tensor, weights: torch.Tensor, teacher: tuple | None, share: float):
    """``(rows, columns, targets, weights)`` of every target: the output at column t-1 predicts label t.

    ``targets`` are the labels, or with ``share`` > 0 and a ``teacher`` (``[rows, T, k]`` ids and
    probabilities), the mixture ``(1 - share) * label + share * teacher`` as :class:`SparseTargets`
    (a target without teacher rows keeps its label).
    """
    target = labels[:, 1:] != IGNORE
    rows, columns = target.nonzero(as_tuple=True)
    hard = labels[:, 1:][target]
    if not share or teacher is None:
        return rows, columns, hard, weights[:, 1:][target]
    ids, probs = (t[:, 1:][target] for t in teacher)
    mix = share * (probs.sum(-1) > 0).float()
    targets = SparseTargets(
        torch.cat([hard[:, None], ids.long()], dim=1), torch.cat([(1 - mix)[:, None], mix[:, None] * probs], dim=1)
    )
    return rows, columns, targets, weights[:, 1:][target]


def loss_at(model, inputs: dict, rows, columns, targets, weights, target_logits: bool):
    """``(sum_i weights_i * CE_i, CE)`` of one forward's outputs at ``(rows, columns)``.

    ``target_logits``: run the output projection only there (head_loss.py; a model whose head is
    not a plain Linear falls back); False takes the model's own full logits.
    """
    if target_logits and has_linear_head(model):
        return target_loss(model, inputs, rows, columns, targets, weights)
    ce = cross_entropy(model(**inputs).logits[rows, columns], targets)
    return (ce * weights).sum(), ce.detach()


def ar_loss(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    normalization: str = "sequence",
    denominator: float | None = None,
    target_logits: bool = True,
    teacher_ids: torch.Tensor | None = None,
    teacher_probs: torch.Tensor | None = None,
    soft_clean: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Plain SFT (stage 1). Returned in the same shape as :func:`mars_loss` for the trainer.

    ``denominator``: what the summed losses are divided by; by default this batch's own
    :func:`normalizer`. The trainer passes the count over every micro-batch of an optimizer step,
    so that gradient accumulation gives the loss and gradients of the whole batch.
    ``target_logits``: run the output projection only at the targets (head_loss.py; a model whose
    head is not a plain Linear falls back); False computes the full-vocabulary logits at every
    column, as the model's own forward does.
    ``teacher_ids``/``teacher_probs`` (``[rows, T, k]``, collate's) and ``soft_clean``: the share of
    the original's distribution in each target (:func:`_targets_at`); 1 is a KL to the original.
    """
    inputs = {"input_ids": input_ids}
    if segment_ids is not None:
        # the two-stream rule without a noisy stream is causal attention inside each sequence
        clean = torch.zeros_like(segment_ids, dtype=torch.bool)
        inputs.update(
            position_ids=position_ids, attention_mask=training_mask(position_ids, segment_ids, clean, 1, model)
        )
    weights = target_weights(labels, segment_ids, normalization)
    if denominator is None:
        denominator = max(1.0, float(weights.sum()))
    teacher = (teacher_ids, teacher_probs) if teacher_ids is not None else None
    rows, columns, targets, target_w = _targets_at(labels, weights, teacher, soft_clean)
    loss, _ = loss_at(model, inputs, rows, columns, targets, target_w / denominator, target_logits)
    return {"loss": loss, "clean_loss": loss.detach()}


def mars_loss(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    options: LossOptions,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    denominator: float | None = None,
    teacher_ids: torch.Tensor | None = None,
    teacher_probs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``noisy + ar_weight * clean`` over one batch, each normalised as :func:`target_weights` says
    (``options``: :class:`LossOptions`). ``denominator`` and the teacher as in :func:`ar_loss`."""
    o = options
    phases = o.masking.phases(segment_ids, len(input_ids), o.block_size)
    batch = two_stream_batch(input_ids, labels, o.block_size, o.mask_token_id, position_ids, segment_ids, phases)
    seq_len = input_ids.shape[1]
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": batch.mask_for(model),
        **split_attention(model, seq_len, segment_ids),
    }

    weights = target_weights(labels, segment_ids, o.normalization)
    if denominator is None:
        denominator = max(1.0, float(weights.sum()))
    teacher = noisy_teacher = None
    if teacher_ids is not None:
        teacher = (teacher_ids, teacher_probs)
        noisy_teacher = tuple(copied_columns(t, batch.noisy_columns) for t in teacher)
    clean = _targets_at(labels, weights, teacher, o.soft_clean)
    noisy = masked_targets(batch, weights, segment_ids, o.masked_weighting, noisy_teacher, o.soft_masked, o.masking)
    rows = torch.cat([clean[0], noisy[0]])
    columns = torch.cat([clean[1], noisy[1] + seq_len])
    targets = SparseTargets.cat(clean[2], noisy[2])
    loss_weights = torch.cat([o.ar_weight * clean[3], noisy[3]]) / denominator
    with placed_masks(model, batch.placed_masks):
        loss, ce = loss_at(model, inputs, rows, columns, targets, loss_weights, o.target_logits)
    n_clean = len(clean[0])
    clean_loss = (ce[:n_clean] * clean[3]).sum() / denominator
    noisy_loss = (ce[n_clean:] * noisy[3]).sum() / denominator
    return {"loss": loss, "noisy_loss": noisy_loss.detach(), "clean_loss": clean_loss.detach()}


@dataclass(frozen=True)
class Masking:
    """How the masked stream covers the data; the defaults are the paper's (one copy, blocks from
    each sequence's start, every offset weighing the same).

    ``random_phase``: each sequence's blocks start at a random phase, drawn per step, so a token is
    trained at a different offset each epoch. ``streams``: noisy copies of each sequence in one
    row, at distinct phases (B copies train every token at every offset in one pass); their loss
    is averaged. ``offset_decay``: a mask's target weighs ``offset_decay ** offset``, so the near
    offsets, which decoding accepts first, count most.
    """

    random_phase: bool = False
    streams: int = 1
    offset_decay: float = 1.0

    def phases(self, segment_ids: torch.Tensor | None, rows: int, block_size: int) -> torch.Tensor:
        return draw_phases(segment_ids, rows, block_size, self.streams, self.random_phase)


@dataclass(frozen=True)
class LossOptions:
    """What a MARS loss is, bound once per run (``recipe.objective_for``): everything but the batch.

    ``ar_weight`` scales the clean stream's loss. ``masked_weighting="inverse-t"`` multiplies each
    sequence's noisy-stream loss by 1/t, t drawn per sequence: the reference's "w/o SFT loss"
    ablation. ``target_logits``, ``soft_clean`` as in :func:`ar_loss`; ``soft_masked`` is the
    original's share in the noisy stream's targets (a mask predicting token t learns the original's
    distribution at t), from its top ``teacher_top_k`` (exact mode). ``masking``: block phases,
    noisy copies and offset weights (:class:`Masking`; the default is the paper's).
    """

    block_size: int
    mask_token_id: int
    ar_weight: float = 1.0
    normalization: str = "sequence"
    masked_weighting: str = "uniform"
    target_logits: bool = True
    soft_clean: float = 0.0
    soft_masked: float = 0.0
    teacher_top_k: int = 16
    masking: Masking = field(default_factory=Masking)


def masked_targets(batch, weights, segment_ids, masked_weighting: str, teacher, share: float, masking: Masking):
    """The noisy stream's ``(rows, columns, targets, weights)`` (:func:`_targets_at`)."""
    if masked_weighting == "inverse-t":
        weights = weights * inverse_t_factors(batch.labels, segment_ids)
    # the noisy columns are copies of clean ones: their targets carry the same weights
    columns = batch.noisy_columns
    noisy_weights = torch.where(columns >= 0, weights.gather(1, columns.clamp(min=0)), 0) / masking.streams
    if masking.offset_decay != 1.0:
        # the output at column i - 1 predicts label i: its offset weighs that target
        offsets = batch.mask_offsets().roll(1, dims=1)
        noisy_weights = noisy_weights * masking.offset_decay ** offsets.to(noisy_weights.dtype)
    return _targets_at(batch.noisy_labels, noisy_weights, teacher, share)


def copied_columns(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``values [rows, T, ...]`` at the clean columns the noisy columns copy; zero at padding (-1)."""
    index = columns.clamp(min=0).reshape(*columns.shape, *[1] * (values.dim() - 2))
    picked = values.gather(1, index.expand(-1, -1, *values.shape[2:]))
    return picked * (columns >= 0).reshape(index.shape).to(picked.dtype)
