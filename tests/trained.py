"""A tiny checkpoint pair trained on the toy suite, shared by the decoding and serving tests.

Seconds of training (AR SFT, then MARS) of the 'test' model preset on a few hundred toy
examples, many epochs over: it memorises them, so on those prompts its confidences spread from
near 0 to near 1 and every acceptance path gets exercised. ``TRAIN_N`` examples, test prompts
should come from ``toy.make_split("train", TRAIN_N)``.
"""

from pathlib import Path

import pytest

from marslm.data import toy
from marslm.data.tokenizer import train_chat_tokenizer
from marslm.demo.toy_model import make_tiny_qwen2
from marslm.modeling import load_model
from marslm.training.config import TrainConfig
from marslm.training.recipe import train

TRAIN_N = 64
# Raw-text prompts some of which the tiny model continues for hundreds of tokens without EOS.
LONG_CANDIDATES = ("def f(x):", "a b c d e f", "Return", "Sort the list", "Write", "the the the", "List:")


def find_long_prompt(model, tokenizer, tokens: int = 300) -> str:
    """A raw-text prompt the tiny model continues without EOS for ``tokens`` tokens (a row that
    stays busy long enough to cancel, or to queue behind)."""
    from marslm import generate

    for text in LONG_CANDIDATES:
        out = generate(model, tokenizer, [text], tau=1.0, max_new_tokens=tokens, apply_chat_template=False)
        if len(out.token_ids[0]) == tokens:
            return text
    pytest.fail("no candidate prompt keeps the tiny model busy: add one to LONG_CANDIDATES")


def build_trained_checkpoints(root: Path) -> dict:
    examples = toy.make_split("train", TRAIN_N, seed=0)
    texts = [m["content"] for ex in examples for m in toy.to_chat_record(ex)["messages"]]
    tokenizer = train_chat_tokenizer(texts, vocab_size=384)
    model = make_tiny_qwen2(tokenizer, "test", seed=0)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    common = dict(
        data="toy", data_n=TRAIN_N, batch_size=16, max_length=160, progress=False, save_steps=10**9, logging_steps=50
    )
    train(
        TrainConfig(
            stage="ar", model=str(root / "base"), output=str(root / "ar"), max_steps=200, learning_rate=3e-3, **common
        )
    )
    train(
        TrainConfig(
            stage="mars",
            model=str(root / "ar"),
            output=str(root / "mars"),
            max_steps=200,
            learning_rate=3e-3,
            block_size=4,
            **common,
        )
    )
    train(
        TrainConfig(
            stage="mars",
            exact=True,
            model=str(root / "ar"),
            output=str(root / "exact"),
            max_steps=150,
            learning_rate=1e-2,
            lora_rank=8,
            random_phase=True,
            block_size=4,
            **common,
        )
    )
    return {"dir": root}


@pytest.fixture(scope="session")
def trained_dirs(tmp_path_factory) -> dict:
    return build_trained_checkpoints(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="session")
def trained_checkpoints(trained_dirs) -> dict:
    """``{"ar64" | "mars64": (float64 model, tokenizer)}`` plus the directories."""
    root = trained_dirs["dir"]
    loaded = {"ar_dir": root / "ar", "mars_dir": root / "mars"}
    for name in ("ar", "mars"):
        model, tokenizer, _ = load_model(str(root / name))
        loaded[name + "64"] = (model.double(), tokenizer)
    return loaded


@pytest.fixture(scope="session")
def exact64(trained_dirs):
    """The exact-mode checkpoint with its adapter, in float64: ``(model, tokenizer)``."""
    import marslm

    model, tokenizer = marslm.load(str(trained_dirs["dir"] / "exact"))
    return model.double(), tokenizer


@pytest.fixture(scope="session")
def original64(trained_dirs):
    """The exact checkpoint's original (its AR parent) under plain ``from_pretrained``, in float64."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = trained_dirs["dir"] / "ar"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    return model.eval(), AutoTokenizer.from_pretrained(path)
