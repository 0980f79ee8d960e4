"""Collation: examples into padded or packed rows, each sequence padded to the block grid.

Batches are right-padded. Real tokens never attend to later columns, so right padding needs no
key mask at all: only the padded query rows compute garbage, and they carry no target. Packed
batches (:func:`collate_packed`) put several sequences end to end in one row instead, with
``position_ids`` restarting at each sequence and ``segment_ids`` telling them apart; the
attention masks then keep every sequence to itself (masks.py).
"""

from __future__ import annotations

import torch

from ..chat import IGNORE


def pad_to_block(input_ids: list[int], labels: list[int], block_size: int, eos_id: int):
    """Extend a sequence with EOS up to a multiple of B, so its last block is full.

    The extra EOS tokens are trained on (as in the authors' code): after an answer ends, the model
    learns to keep predicting EOS, which is what a mask block straddling the end must output.
    A sequence that was truncated mid-answer is padded with untrained EOS instead.
    """
    missing = -len(input_ids) % block_size
    trained = bool(labels) and labels[-1] == eos_id
    return (input_ids + [eos_id] * missing, labels + [eos_id if trained else IGNORE] * missing)


# Optional per-token arrays an example may carry beside its labels: the original model's top-k
# (ids, probabilities) for the token at each position (teacher.py). Rows are zero where none.
TEACHER_KEYS = ("teacher_ids", "teacher_probs")


def _sequences(examples: list[dict], block_size: int, eos_id: int | None) -> list[dict]:
    """Each example's ``input_ids``, ``labels`` (and teacher rows), EOS-padded to a block multiple when B > 1."""
    seqs = []
    for ex in examples:
        ids, labels = list(ex["input_ids"]), list(ex["labels"])
        if block_size > 1:
            ids, labels = pad_to_block(ids, labels, block_size, eos_id)
        seq = {"input_ids": ids, "labels": labels}
        for key in TEACHER_KEYS:
            if key in ex:
                rows = torch.as_tensor(ex[key])
                seq[key] = torch.cat([rows, rows.new_zeros(len(ids) - len(rows), rows.shape[1])])
        seqs.append(seq)
    return seqs


def _empty_batch(seqs: list[dict], rows: int, width: int, pad_id: int) -> dict:
    """Tensors for ``rows`` rows of ``width`` columns: padding, no targets, no teacher."""
    batch = {
        "input_ids": torch.full((rows, width), pad_id, dtype=torch.long),
        "labels": torch.full((rows, width), IGNORE, dtype=torch.long),
    }
    for key in TEACHER_KEYS:
        if key in seqs[0]:
            batch[key] = seqs[0][key].new_zeros(rows, width, seqs[0][key].shape[1])
    return batch


def _place(batch: dict, seq: dict, row: int, start: int) -> int:
    """Write one sequence into ``batch`` at ``row`` from column ``start``; returns where it ends."""
    end = start + len(seq["input_ids"])
    for key, value in seq.items():
        batch[key][row, start:end] = torch.as_tensor(value)
    return end


def collate(examples: list[dict], pad_id: int, block_size: int = 1, eos_id: int | None = None) -> dict:
    """Right-pad ``{"input_ids", "labels"}`` examples into tensors; EOS-pad each to a block multiple."""
    seqs = _sequences(examples, block_size, eos_id)
    batch = _empty_batch(seqs, len(seqs), max(len(seq["input_ids"]) for seq in seqs), pad_id)
    for row, seq in enumerate(seqs):
        _place(batch, seq, row, 0)
    return batch


def collate_packed(
    examples: list[dict], pad_id: int, block_size: int = 1, eos_id: int | None = None, row_width: int | None = None
) -> dict:
    """Pack ``{"input_ids", "labels"}`` examples into as few rows of ``row_width`` tokens as fit.

    The default width is 1.5x the longest sequence: wider rows pack tighter, but the cost of
    masked attention grows with the square of the width.

    First-fit over the examples longest first. A row's sequences follow each other and its unused
    tail is padding (segment -1, no targets). Each sequence's first label is dropped: in a padded
    batch nothing predicts it, and here the previous sequence's last token would.
    """
    seqs = _sequences(examples, block_size, eos_id)
    for seq in seqs:
        seq["labels"] = [IGNORE] + seq["labels"][1:]
    longest = max(len(seq["input_ids"]) for seq in seqs)
    width = max(longest, row_width or -(-3 * longest // 2))
    rows: list[list[dict]] = []
    free: list[int] = []
    for seq in sorted(seqs, key=lambda seq: -len(seq["input_ids"])):
        row = next((r for r, room in enumerate(free) if room >= len(seq["input_ids"])), None)
        if row is None:
            rows.append([])
            free.append(width)
            row = len(rows) - 1
        rows[row].append(seq)
        free[row] -= len(seq["input_ids"])
    batch = _empty_batch(seqs, len(rows), width, pad_id)
    batch["position_ids"] = torch.zeros((len(rows), width), dtype=torch.long)
    batch["segment_ids"] = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for segment, seq in enumerate(row):
            end = _place(batch, seq, r, start)
            batch["position_ids"][r, start:end] = torch.arange(end - start)
            batch["segment_ids"][r, start:end] = segment
            start = end
        batch["position_ids"][r, start:] = torch.arange(width - start)
    return batch
