"""Shared fixtures: a tiny chat tokenizer, tiny random models, saved model dirs and chat JSONL.

Everything here is small enough to build in well under a second, so tests stay fast on CPU.

    tiny_tokenizer          session-wide Qwen2Tokenizer (ids 0..3: <|endoftext|>, <|im_start|>,
                            <|im_end|> (eos), <|mask|>) trained on a synthetic arithmetic chat corpus
    make_tiny_model         factory: make_tiny_model(arch="qwen2"|"llama", attn="sdpa"|"eager", seed=0,
                            vocab_size=None)  (default: vocab rounded up to 64, so spare rows exist)
    save_model              fixture: save_model(model, tokenizer, path=None) -> Path (save_pretrained dir)
    write_chat_jsonl        fixture: write_chat_jsonl(path, n, seed=0) -> Path ({"messages": [...]} per line)
    tiny_model_dir          session-wide saved random Qwen2 dir (with tokenizer); treat as read-only
    outside_dir             a world-writable directory the code sandbox can see but must not change
    trained_dirs, trained_checkpoints   re-exported from tests/trained.py (toy-trained checkpoint pair)

Plain helpers, importable with ``from conftest import ...``: chat_conversations(n, seed=0),
build_tiny_model(tokenizer, arch, attn, seed, vocab_size), save_model_dir(model, tokenizer, path),
write_chat_jsonl_file(path, n, seed=0).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

# Quiet, offline Hugging Face for the whole test session (subprocesses inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and on a small, busy CPU box OpenMP threads
# contending with other processes can make each op 100x slower. Subprocesses inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

VOCAB_MULTIPLE = 64
TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True)


def chat_example(rng: random.Random) -> list[dict]:
    """One synthetic conversation: "What is 3 plus 4?" -> "3 plus 4 is 7. The answer is 7."."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        q, ans, op = f"What is {a} plus {b}?", a + b, "plus"
    else:
        a, b = max(a, b), min(a, b)
        q, ans, op = f"What is {a} minus {b}?", a - b, "minus"
    return [{"role": "user", "content": q},
            {"role": "assistant", "content": f"{a} {op} {b} is {ans}. The answer is {ans}."}]


def chat_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [chat_example(rng) for _ in range(n)]


def _corpus_texts(n: int = 400) -> list[str]:
    texts = []
    for messages in chat_conversations(n, seed=123):
        texts += [m["content"] for m in messages]
    texts += ["You are a helpful assistant.", "system", "user", "assistant"] * 4
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from marslm.data.tokenizer import train_chat_tokenizer

    return train_chat_tokenizer(_corpus_texts(), vocab_size=320)


def build_tiny_model(tokenizer, arch: str = "qwen2", attn: str = "sdpa", seed: int = 0,
                     vocab_size: int | None = None):
    """A tiny random causal LM, fp32. By default the embedding has spare rows (vocab rounded up
    to a multiple of 64, like Qwen2.5); pass ``vocab_size=len(tokenizer)`` for none."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = vocab_size or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    common = dict(TINY_SIZES, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  attn_implementation=attn, dtype="float32")
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
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    assert model.config._attn_implementation == attn
    return model.float().eval()


@pytest.fixture(scope="session")
def make_tiny_model(tiny_tokenizer):
    """``make_tiny_model(arch="qwen2", attn="sdpa", seed=0, vocab_size=None)``: same arch+seed -> same weights."""

    def factory(arch: str = "qwen2", attn: str = "sdpa", seed: int = 0, vocab_size: int | None = None):
        if vocab_size is not None:
            return build_tiny_model(tiny_tokenizer, arch, attn, seed, vocab_size)
        if arch == "qwen2" and attn == "sdpa":
            # The package's own recipe, so the tests exercise what users get.
            from marslm.toy_model import make_tiny_qwen2

            return make_tiny_qwen2(tiny_tokenizer, "test", seed=seed).eval()
        return build_tiny_model(tiny_tokenizer, arch, attn, seed)

    return factory


def save_model_dir(model, tokenizer, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def save_model(tmp_path_factory):
    """``save_model(model, tokenizer, path=None) -> Path``: a plain save_pretrained directory."""

    def saver(model, tokenizer, path=None):
        return save_model_dir(model, tokenizer, path or tmp_path_factory.mktemp("model"))

    return saver


def write_chat_jsonl_file(path, n: int, seed: int = 0) -> Path:
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for messages in chat_conversations(n, seed=seed):
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="session")
def write_chat_jsonl():
    """``write_chat_jsonl(path, n, seed=0) -> Path``: n chat records, one JSON object per line."""
    return write_chat_jsonl_file


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_tokenizer, make_tiny_model, tmp_path_factory) -> Path:
    """A saved random tiny Qwen2 with its tokenizer (has <|mask|> and spare rows). Do not write into it."""
    return save_model_dir(make_tiny_model("qwen2", "sdpa", seed=0), tiny_tokenizer,
                          tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture
def outside_dir():
    """A world-writable directory on the machine that the code sandbox sees (read-only): under
    /var/tmp, since the sandbox replaces /tmp with its own. A write or delete there by sandboxed
    code is an escape."""
    path = Path(tempfile.mkdtemp(prefix="marslm-outside-", dir="/var/tmp" if os.path.isdir("/var/tmp") else "."))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Fixtures of tests/trained.py (a tiny checkpoint pair trained on the toy suite, for the decoding
# and serving tests), registered here so any test module can request them by name.
try:
    from tests.trained import trained_checkpoints, trained_dirs  # noqa: E402,F401
except ImportError:  # pragma: no cover - module not present (or not importable as tests.trained)
    pass
