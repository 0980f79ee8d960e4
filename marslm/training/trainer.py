"""The ``transformers.Trainer`` that trains with a MARS (or AR) loss function, crash-safely.

Imported by ``recipe.train`` once its input is known to be good: importing transformers is the
slow part of a bad command line.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Trainer

from .checkpoints import NonFiniteTraining, mark_checkpoint_complete, require_finite_parameters
from .collate import TEACHER_KEYS
from .objective import normalizer


class CrashSafeCheckpoints:
    """Trainer mixin: no checkpoint counts until it is complete (checkpoints.py), and no garbage
    is saved: a loss that is not finite stops the run, and weights that are not finite are never
    written."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss).all():
            raise NonFiniteTraining(f"the loss became {float(loss)} at step {self.state.global_step + 1}")
        return loss

    def _save_checkpoint(self, model, trial):
        require_finite_parameters(self.model, self.state.global_step)
        super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank's shards are written
        if self.args.should_save:
            mark_checkpoint_complete(Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}")


class MarsTrainer(CrashSafeCheckpoints, Trainer):
    """Trainer with the stage's loss (objective.mars_loss / ar_loss), normalised over the whole
    optimizer step; logs the noisy/clean terms next to the total.

    Trainer fetches all micro-batches of an optimizer step before running them
    (``get_batch_samples``). The step's denominator (its targets, or its sequences, over every
    micro-batch and every process) is counted there, and each micro-batch's summed losses are
    divided by it, so the micro-batch losses add up to the loss of the whole batch and gradient
    accumulation changes nothing. Trainer must then not divide again.

    ``own_lr``: ``{parameter: learning rate}`` for parameters that get an optimizer group of their
    own, without weight decay (the mask token's row: surgery.train_embedding_rows; exact mode's mask rows).
    """

    loss_is_scaled_for_ga = True
    # what a batch carries beside input_ids and labels that the loss reads
    LOSS_INPUTS = ("position_ids", "segment_ids", *TEACHER_KEYS)

    def __init__(self, *args, loss_fn, normalization: str, own_lr: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = loss_fn
        self.normalization = normalization
        self.own_lr = own_lr or {}
        self._sums: dict[str, float] = {}
        self._window_start = 0  # the global step the per-term sums started at

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        for param, lr in self.own_lr.items():
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p is not param]
            optimizer.add_param_group({"params": [param], "lr": lr, "weight_decay": 0.0})
        return optimizer

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        count = sum(normalizer(b["labels"], b.get("segment_ids"), self.normalization) for b in batches)
        count = torch.tensor(float(count), device=device)
        if self.accelerator.num_processes > 1:
            count = self.accelerator.reduce(count, reduction="sum")
        return batches, count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._sums:
            self._window_start = self.state.global_step
        terms = self.loss_fn(
            model,
            inputs["input_ids"],
            inputs["labels"],
            **{k: inputs[k] for k in self.LOSS_INPUTS if k in inputs},
            denominator=None if num_items_in_batch is None else float(num_items_in_batch),
        )
        for key, value in terms.items():
            if key != "loss":
                self._sums[key] = self._sums.get(key, 0.0) + float(value)
        # Data-parallel training averages gradients over processes; the denominator already
        # counts every process's batch, so scale the sum back up.
        return terms["loss"] * self.accelerator.num_processes

    def log(self, logs, *a, **kw):
        steps = self.state.global_step - self._window_start
        if self._sums and "loss" in logs and steps > 0:
            # Every rank logs at the same step (Trainer gathers the loss there too): each rank's
            # share of a term sums to the term over ranks.
            names = sorted(self._sums)
            local = torch.tensor([self._sums[k] / steps for k in names], device=self.args.device)
            total = self.accelerator.reduce(local, reduction="sum")
            logs.update({k: round(float(v), 4) for k, v in zip(names, total)})
            self._sums = {}
        super().log(logs, *a, **kw)
