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
``JacobiBatch`` (jacobi_batch.py) is a decoder like the others, built by decoder.make_decoder
and driven by ``generate``'s loop; this module is its entry point.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chat import encode_prompt, stop_token_ids
from ..errors import UserError
from .decoder import make_decoder
from .generation import run_to_completion
from .params import DecoderOptions, DecodingParams
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
