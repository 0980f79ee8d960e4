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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chat import encode_prompt, stop_token_ids
from ..errors import UserError


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


@torch.no_grad()
def _decode_one(
    model, prompt_ids: list[int], window: int, max_new_tokens: int, stop_ids: set[int]
) -> tuple[list[int], list[int]]:
    """(new tokens with the stop token if one came, tokens committed per forward) for one prompt."""
    device = model.device
    generated: list[int] = []
    accepted_per_step: list[int] = []
    guesses = [prompt_ids[-1]] * window  # no better guess before the first forward
    while len(generated) < max_new_tokens:
        prefix = prompt_ids + generated
        input_ids = torch.tensor([prefix + guesses], device=device)
        logits = model(input_ids=input_ids).logits[0]
        # The output at the last prefix position predicts the first guess's slot, and so on; the
        # output at the last guess predicts one token past the window.
        predictions = logits[len(prefix) - 1 :].argmax(dim=-1).tolist()  # window + 1 of them

        committed = predictions[: _committed_count(guesses, predictions)]
        committed = committed[: max_new_tokens - len(generated)]
        for i, token in enumerate(committed):  # stop at the first stop token, keeping it
            if token in stop_ids:
                committed = committed[: i + 1]
                break
        generated += committed
        accepted_per_step.append(len(committed))
        if committed[-1] in stop_ids:
            break
        # The predictions past the committed ones are the next iteration's guesses, shifted left;
        # pad with the last of them to keep the window full.
        guesses = predictions[len(committed) :][:window]
        guesses += [guesses[-1] if guesses else generated[-1]] * (window - len(guesses))
    return generated, accepted_per_step


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
    stop_ids = set(stop_token_ids(tokenizer, getattr(model, "generation_config", None)))

    texts, token_ids, forwards, accepted = [], [], [], []
    for prompt in prompts:
        generated, steps = _decode_one(
            model, encode_prompt(tokenizer, prompt, apply_chat_template), window, max_new_tokens, stop_ids
        )
        answer = generated[:-1] if generated and generated[-1] in stop_ids else generated
        texts.append(tokenizer.decode(answer, skip_special_tokens=True))
        token_ids.append(answer)
        forwards.append(len(steps))
        accepted.append(steps)
    return JacobiResult(texts, token_ids, forwards, accepted)
