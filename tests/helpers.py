"""Plain test helpers, imported as ``from tests.helpers import ...`` (fixtures live in conftest.py).

chat_conversations(n, seed=0)        synthetic "What is 3 plus 4?" conversations
corpus_texts(n=400)                  texts to train the tiny tokenizer on
build_tiny_model(tokenizer, arch="qwen2", attn="sdpa", seed=0, vocab_size=None)
save_model_dir(model, tokenizer, path) -> Path
write_chat_jsonl_file(path, n, seed=0) -> Path
hf_greedy(model, tokenizer, prompt_ids, max_new_tokens)   transformers' own greedy decoding
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

VOCAB_MULTIPLE = 64
TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def chat_example(rng: random.Random) -> list[dict]:
    """One synthetic conversation: "What is 3 plus 4?" -> "3 plus 4 is 7. The answer is 7."."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        q, ans, op = f"What is {a} plus {b}?", a + b, "plus"
    else:
        a, b = max(a, b), min(a, b)
        q, ans, op = f"What is {a} minus {b}?", a - b, "minus"
    return [
        {"role": "user", "content": q},
        {"role": "assistant", "content": f"{a} {op} {b} is {ans}. The answer is {ans}."},
    ]


def chat_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [chat_example(rng) for _ in range(n)]


def corpus_texts(n: int = 400) -> list[str]:
    texts = []
    for messages in chat_conversations(n, seed=123):
        texts += [m["content"] for m in messages]
    texts += ["You are a helpful assistant.", "system", "user", "assistant"] * 4
    return texts


def build_tiny_model(tokenizer, arch: str = "qwen2", attn: str = "sdpa", seed: int = 0, vocab_size: int | None = None):
    """A tiny random causal LM, fp32. By default the embedding has spare rows (vocab rounded up
    to a multiple of 64, like Qwen2.5); pass ``vocab_size=len(tokenizer)`` for none."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = vocab_size or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    common = dict(
        TINY_SIZES,
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation=attn,
        dtype="float32",
    )
    if arch == "qwen2":
        config_cls, model_cls = Qwen2Config, Qwen2ForCausalLM
    elif arch == "llama":
        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    config = config_cls(**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    assert model.config._attn_implementation == attn
    return model.float().eval()


def save_model_dir(model, tokenizer, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_chat_jsonl_file(path, n: int, seed: int = 0) -> Path:
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for messages in chat_conversations(n, seed=seed):
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def hf_greedy(model, tokenizer, prompt_ids, max_new_tokens):
    """Reference: transformers' own greedy decoding, left-padded batch; stop token and padding removed."""
    width = max(map(len, prompt_ids))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    out = model.generate(
        input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
    )
    results = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        results.append([t for t in row if t != pad])
    return results


def stage_loss_and_grads(model, batch: dict, stage: str, **options):
    """``(loss terms, {name: gradient})`` after one backward of a stage's loss on a collated batch
    (padded or packed; B = 4 and mask id 3 for ``mars``); ``options`` go to the loss."""
    from marslm.training.collate import TEACHER_KEYS
    from marslm.training.objective import LossOptions, ar_loss, mars_loss

    extra = {k: batch[k] for k in ("position_ids", "segment_ids", *TEACHER_KEYS) if k in batch}
    if stage == "mars":
        terms = mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, 3, **options), **extra)
    else:
        terms = ar_loss(model, batch["input_ids"], batch["labels"], **extra, **options)
    terms["loss"].backward()
    return terms, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(got, want, loss_atol: float = 1e-5) -> None:
    """Two :func:`stage_loss_and_grads` results agree: every loss term and every gradient."""
    import torch

    (got_terms, got_grads), (want_terms, want_grads) = got, want
    for key in want_terms:
        torch.testing.assert_close(got_terms[key], want_terms[key], rtol=1e-5, atol=loss_atol)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6)


def tiny_llama(vocab_size: int, *, hidden_size: int, num_hidden_layers: int, seed: int, head_scale: float = 1.0):
    """A random Llama of ``vocab_size`` rows, float64, in eval mode. ``head_scale`` multiplies the
    output projection: 6 gives logits on the scale of a real model's, neither flat nor one-hot."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model.double().eval()
