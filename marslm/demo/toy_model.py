"""Tiny Qwen2-architecture models, built from scratch for the embedded default.

No model hub is reachable, so marslm ships the recipe for a small model instead
of weights. It is a stock ``Qwen2ForCausalLM``: once saved, it loads with
``AutoModelForCausalLM.from_pretrained(dir)`` and no custom code, so everything
that works on it works on a real Qwen2.5 checkpoint and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

# Real Qwen2.5 pads its embedding matrix past the tokenizer's vocabulary
# (151,665 tokens, 151,936 rows) for GPU-friendly matmul shapes. We keep that
# trait so code that assumes `len(tokenizer) == vocab_size` breaks here rather
# than on a real checkpoint. The spare rows are never targets, so training
# drives their logits down; an untrained model can still emit them, and the
# tokenizer decodes such ids to nothing.
VOCAB_MULTIPLE = 64


@dataclass
class TinyModelSpec:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0


MODEL_SIZES: dict[str, TinyModelSpec] = {
    # Unit tests: builds and runs a forward pass in milliseconds (~0.1M params).
    "test": TinyModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
    ),
    # Smoke runs of the full pipeline on CPU in minutes (~1.3M params).
    "quick": TinyModelSpec(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _resolve(spec: TinyModelSpec | str) -> TinyModelSpec:
    if isinstance(spec, TinyModelSpec):
        return spec
    try:
        return MODEL_SIZES[spec]
    except KeyError:
        raise ValueError(f"unknown model size {spec!r}; choose one of {sorted(MODEL_SIZES)}") from None


def make_tiny_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    spec: TinyModelSpec | str = "quick",
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A freshly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer``.

    The same ``seed`` (and spec, and tokenizer) gives bit-identical weights.
    The caller's global RNG state is left untouched.
    """
    spec = _resolve(spec)
    if spec.hidden_size % spec.num_attention_heads:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    config = Qwen2Config(
        vocab_size=_round_up(len(tokenizer), VOCAB_MULTIPLE),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        # transformers 5 reads RoPE settings from `rope_parameters`; a bare
        # `rope_theta` is only accepted as a legacy alias.
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
        dtype="float32",
    )

    # fork_rng confines the seeding to this block, so building a model does not
    # silently reseed the caller's data shuffling or dropout.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)

    # Without this, `generate` runs to max_length past <|im_end|> and warns
    # about a missing pad token on every call.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model
