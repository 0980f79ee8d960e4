"""``JacobiBatch``: Jacobi decoding of one row at a time, a decoder behind the interface every
decoder shares (decoder.py). The method and its entry point: jacobi.py."""

from __future__ import annotations

import torch

from .rows import BatchStats, FinishedRow


def _committed_count(guesses: list[int], predictions: list[int]) -> int:
    """How many predictions are exact: the first always; then one more per leading guess that held.

    ``predictions[i]`` was conditioned on ``guesses[:i]``; it is exact when all of those guesses
    equal the predictions made for their own positions (they did not change this iteration).
    """
    count = 1
    for guess, prediction in zip(guesses, predictions):
        if guess != prediction:
            break
        count += 1
    return count


class JacobiBatch:
    """Jacobi decoding of one row at a time behind the interface every decoder shares
    (decoder.py): each :meth:`step` is one causal forward over prefix + guesses, without a cache."""

    joins_running = True
    max_rows = 1
    mask_batch_limit = None

    def __init__(self, model, window: int, stop_ids):
        self.model, self.window, self.stop_ids = model, window, set(stop_ids)
        self.stats = BatchStats()
        self.row = None
        self.last: list[int] = []

    def __len__(self) -> int:
        return int(self.row is not None)

    def add(self, prompts: list[list[int]], settings: list, request_ids: list) -> None:
        if not prompts:
            return
        if len(self) + len(prompts) > 1:
            raise ValueError("Jacobi decoding runs one row at a time")
        prompt = list(prompts[0])
        # no better guess before the first forward than the prompt's last token
        self.row = dict(
            id=request_ids[0],
            prompt=prompt,
            new=[],
            steps=[],
            guesses=[prompt[-1]] * self.window,
            max_new=settings[0].max_new_tokens,
        )

    @torch.no_grad()
    def step(self) -> list[FinishedRow]:
        """One forward; the guesses that were fixed points are committed (:func:`_committed_count`)."""
        self.last = []
        if self.row is None:
            return []
        row, device = self.row, next(self.model.parameters()).device
        prefix = row["prompt"] + row["new"]
        self.stats.forwards += 1
        logits = self.model(input_ids=torch.tensor([prefix + row["guesses"]], device=device)).logits[0]
        # The output at the last prefix position predicts the first guess's slot, and so on; the
        # output at the last guess predicts one token past the window.
        predictions = logits[len(prefix) - 1 :].argmax(dim=-1).tolist()  # window + 1 of them
        committed = predictions[: _committed_count(row["guesses"], predictions)]
        committed = committed[: row["max_new"] - len(row["new"])]
        stopped = next((i for i, token in enumerate(committed) if token in self.stop_ids), None)
        if stopped is not None:  # the row ends at its first stop token, which counts as decoded
            committed = committed[: stopped + 1]
        row["new"] += committed
        row["steps"].append(len(committed))
        if stopped is not None or len(row["new"]) >= row["max_new"]:
            return self._pop(stopped is not None)
        self.last = committed
        # The predictions past the committed ones are the next iteration's guesses, shifted left;
        # pad with the last of them to keep the window full.
        guesses = predictions[len(committed) :][: self.window]
        row["guesses"] = guesses + [guesses[-1] if guesses else row["new"][-1]] * (self.window - len(guesses))
        return []

    def new_tokens(self) -> dict:
        return {self.row["id"]: list(self.last)} if self.row is not None and self.last else {}

    def stop(self, request_ids) -> list[FinishedRow]:
        return self._pop(False) if self.row is not None and self.row["id"] in set(request_ids) else []

    def cancel(self, request_ids) -> None:
        self.stop(request_ids)

    def set_tau(self, request_ids, tau: float) -> None:
        """Jacobi decoding reads no tau."""

    def _pop(self, stopped: bool) -> list[FinishedRow]:
        row, self.row, self.last = self.row, None, []
        answer = row["new"][:-1] if stopped else row["new"]
        return [FinishedRow(row["id"], answer, stopped, row["steps"])]
