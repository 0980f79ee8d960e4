"""Shared fixtures: a tiny chat tokenizer, tiny random models, saved model dirs and chat JSONL.

Everything here is small enough to build in well under a second, so tests stay fast on CPU.

    tiny_tokenizer          session-wide Qwen2Tokenizer (ids 0..3: <|endoftext|>, <|im_start|>,
                            <|im_end|> (eos), <|mask|>) trained on a synthetic arithmetic chat corpus
    make_tiny_model         factory: make_tiny_model(arch="qwen2"|"llama", attn="sdpa"|"eager", seed=0,
                            vocab_size=None)  (default: vocab rounded up to 64, so spare rows exist)
    save_model              fixture: save_model(model, tokenizer, path=None) -> Path (save_pretrained dir)
    write_chat_jsonl        fixture: write_chat_jsonl(path, n, seed=0) -> Path ({"messages": [...]} per line)
    tiny_model_dir          session-wide saved random Qwen2 dir (with tokenizer); treat as read-only
    drafter_dirs            {"target": tiny_model_dir, "drafter": other random weights, same tokenizer,
                            "other": the same rows with another tokenizer} for separate-drafter tests
    outside_dir             a world-writable directory of the machine the code sandbox must not reach
    trained_dirs, trained_checkpoints   re-exported from tests/trained.py (toy-trained checkpoint pair)

Plain helpers live in tests/helpers.py (``from tests.helpers import ...``).
"""

from __future__ import annotations

import os
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
# Tokenised datasets are cached (train.cached_encoding): in a directory of the test session's own.
os.environ.setdefault("MARSLM_CACHE", tempfile.mkdtemp(prefix="marslm-cache-"))
# The library's defaults compile the decoding step (compile_policy.py) and measure a cost table on
# first need (costs.py): per tiny random model that is compile time and a changed baseline, so the
# suite decodes eagerly and reads saved tables only; the tests of those defaults set them back.
os.environ["MARSLM_COMPILE"] = "off"
os.environ["MARSLM_COSTS"] = "off"

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from tests.helpers import build_tiny_model, corpus_texts, save_model_dir, write_chat_jsonl_file  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from marslm.data.tokenizer import train_chat_tokenizer

    return train_chat_tokenizer(corpus_texts(), vocab_size=320)


@pytest.fixture(scope="session")
def make_tiny_model(tiny_tokenizer):
    """``make_tiny_model(arch="qwen2", attn="sdpa", seed=0, vocab_size=None)``: same arch+seed -> same weights."""

    def factory(arch: str = "qwen2", attn: str = "sdpa", seed: int = 0, vocab_size: int | None = None):
        if vocab_size is not None:
            return build_tiny_model(tiny_tokenizer, arch, attn, seed, vocab_size)
        if arch == "qwen2" and attn == "sdpa":
            # The package's own recipe, so the tests exercise what users get.
            from marslm.demo.toy_model import make_tiny_qwen2

            return make_tiny_qwen2(tiny_tokenizer, "test", seed=seed).eval()
        return build_tiny_model(tiny_tokenizer, arch, attn, seed)

    return factory


@pytest.fixture(scope="session")
def save_model(tmp_path_factory):
    """``save_model(model, tokenizer, path=None) -> Path``: a plain save_pretrained directory."""

    def saver(model, tokenizer, path=None):
        return save_model_dir(model, tokenizer, path or tmp_path_factory.mktemp("model"))

    return saver


@pytest.fixture(scope="session")
def write_chat_jsonl():
    """``write_chat_jsonl(path, n, seed=0) -> Path``: n chat records, one JSON object per line."""
    return write_chat_jsonl_file


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_tokenizer, make_tiny_model, tmp_path_factory) -> Path:
    """A saved random tiny Qwen2 with its tokenizer (has <|mask|> and spare rows). Do not write into it."""
    return save_model_dir(
        make_tiny_model("qwen2", "sdpa", seed=0), tiny_tokenizer, tmp_path_factory.mktemp("tiny_qwen2")
    )


@pytest.fixture(scope="session")
def drafter_dirs(tiny_model_dir, make_tiny_model, tiny_tokenizer, tmp_path_factory) -> dict:
    """A target and drafters for it, saved: ``drafter`` (drafts mostly rejected: other random
    weights) and ``other`` (refused: the same rows, another tokenizer)."""
    from marslm.data.tokenizer import train_chat_tokenizer

    other_tokenizer = train_chat_tokenizer(corpus_texts(100), vocab_size=300)
    return {
        "target": tiny_model_dir,
        "drafter": save_model_dir(make_tiny_model(seed=1), tiny_tokenizer, tmp_path_factory.mktemp("drafter")),
        "other": save_model_dir(make_tiny_model(seed=2), other_tokenizer, tmp_path_factory.mktemp("other")),
    }


@pytest.fixture
def outside_dir():
    """A world-writable directory on the machine, where shared files and sockets live: under
    /var/tmp, as /tmp is where the sandbox has its own. A write, delete or connect there by
    sandboxed code is an escape."""
    path = Path(tempfile.mkdtemp(prefix="marslm-outside-", dir="/var/tmp" if os.path.isdir("/var/tmp") else "."))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Fixtures of tests/trained.py (a tiny checkpoint pair trained on the toy suite, for the decoding
# and serving tests), registered here so any test module can request them by name.
from tests.trained import exact64, original64, trained_checkpoints, trained_dirs  # noqa: E402,F401
