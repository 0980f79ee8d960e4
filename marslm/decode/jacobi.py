"""Jacobi decoding: the training-free multi-token baseline for a plain AR model.

The paper compares MARS against Jacobi decoding on the same AR SFT model (1.07 tokens per
forward there, against 1.46 for MARS at tau = 0.95). Jacobi decoding guesses the next ``window``
tokens, runs one causal forward over prefix + guesses, and replaces the guesses by the model's
argmax predictions at those positions. A guess that equals the prediction made from the guesses
before it is a fixed point: every token up to it was conditioned on exactly what greedy AR
decoding would have produced, so it can be committed. The first prediction (made from the prefix
alone) is always exact, so each forward commits at least one token and the output is greedy AR
decoding token for token.

Deliberately simple: one prompt at a time, no KV cache (each forward recomputes the prefix).
That costs wall-clock time, not tokens per forward, which is what the comparison measures.
``JacobiBatch`` is a decoder like the others, built by decoder.make_decoder and driven by
``generate``'s loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chat import encode_prompt, stop_token_ids
from ..errors import UserError
from .decoder import make_decoder
from .generation import run_to_completion
from .params import DecoderOptions, DecodingParams
from .rows import BatchStats, FinishedRow
from .run_loop import RunLoop


@dataclass
class JacobiResult:
    texts: list[str]
    token_ids: list[list[int]]  # new tokens per prompt, stop token excluded
    forwards: list[int]  # forwards per prompt
    accepted_per_step: list[list[int]]  # tokens committed by each forward (stop token included)

    @property
    def tokens_per_forward(self) -> float:
        """Decoded tokens (stop tokens included) per forward, over all prompts."""
        forwards = sum(self.forwards)
        return sum(map(sum, self.accepted_per_step)) / forwards if forwards else 0.0


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


def jacobi_generate(
    model, tokenizer, prompts, *, window: int = 4, max_new_tokens: int = 256, apply_chat_template: bool = True
) -> JacobiResult:
    """Greedy Jacobi decoding of ``prompts`` (strings, message lists or token-id lists), one at a time.

    The output equals greedy AR decoding (``model.generate(do_sample=False)``) token for token.
    """
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        raise UserError("prompts must be a list (of strings, message lists or token-id lists)")
    if window < 1:
        raise UserError(f"Jacobi window must be >= 1, got {window}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    prompt_ids = [encode_prompt(tokenizer, prompt, apply_chat_template) for prompt in prompts]
    params = [DecodingParams(max_new_tokens=max_new_tokens)] * len(prompt_ids)
    decoder = make_decoder(model, DecoderOptions(), stop_ids=stop_ids, jacobi_window=window)
    rows = run_to_completion(RunLoop(decoder), prompt_ids, params)
    return JacobiResult(
        texts=[tokenizer.decode(row.token_ids, skip_special_tokens=True) for row in rows],
        token_ids=[row.token_ids for row in rows],
        forwards=[row.forwards for row in rows],
        accepted_per_step=[row.accepted_per_step for row in rows],
    )
