"""Rule 1 of issue 36: a training cache is keyed on everything it depends on, and checked when read.

The tokenised-data key covers the tokenizer's merges, the chat template and the stop ids; the
teacher key the model's config and its weights' contents; a cache that loads but holds the wrong
thing is named in one line and computed again; a resumed run knows its data by its bytes; and a
cache directory that cannot be written is refused before any work."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace

import pytest
import torch

from marslm.chat import IGNORE, stop_token_ids
from marslm.errors import UserError
from marslm.training.cache import cache_dir, cached, model_identity, teacher_problem
from marslm.training.config import TrainConfig
from marslm.training.dataset import cached_encoding, encoding_key
from marslm.training.recipe import train
from tests.test_train_reliability import Interrupted, interrupt_at, run_cli


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tokenizer_dir(tiny_tokenizer, path):
    tiny_tokenizer.save_pretrained(path)
    return path


def _edit_merges(path):
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (path / "tokenizer.json").write_text(json.dumps(spec))


def _edit_template(path):
    config = json.loads((path / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ", 1)
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        template = path / "chat_template.jinja"
        template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> ", 1))


@pytest.mark.parametrize("edit", [_edit_merges, _edit_template], ids=["bpe-merges", "chat-template"])
def test_the_data_key_covers_the_tokenizer_files(tiny_tokenizer, tmp_path, edit):
    from transformers import AutoTokenizer

    cfg = TrainConfig(stage="mars", model="m", data="toy", output=str(tmp_path / "o"), data_n=4)
    path = _tokenizer_dir(tiny_tokenizer, tmp_path / "tok")
    before = AutoTokenizer.from_pretrained(path)
    edit(path)
    after = AutoTokenizer.from_pretrained(path)
    stop = stop_token_ids(before)
    assert encoding_key(cfg, before, stop, stop[0]) != encoding_key(cfg, after, stop, stop[0])


def test_the_data_key_covers_the_stop_ids(tiny_tokenizer, tmp_path):
    """An EOS id added in generation_config.json ends turns differently: another encoding."""
    cfg = TrainConfig(stage="mars", model="m", data="toy", output=str(tmp_path / "o"), data_n=4)
    stop = stop_token_ids(tiny_tokenizer)
    assert encoding_key(cfg, tiny_tokenizer, stop, stop[0]) != encoding_key(cfg, tiny_tokenizer, stop + [0], stop[0])


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_the_teacher_key_covers_the_config(model_dir, cache):
    from transformers import AutoModelForCausalLM

    before = model_identity(str(model_dir), AutoModelForCausalLM.from_pretrained(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (model_dir / "config.json").write_text(json.dumps(config))
    assert model_identity(str(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)) != before


def test_the_teacher_key_covers_the_weights_contents(model_dir, cache):
    """Other weights of the same size and mtime are other weights."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    before = model_identity(str(model_dir), model)
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert model_identity(str(model_dir), model) != before


def test_the_weights_are_hashed_once_per_file_version(model_dir, cache, monkeypatch):
    import marslm.training.cache as cache_module

    model = type("M", (), {"config": type("C", (), {"to_dict": lambda self: {}})()})()
    hashed = []
    real = cache_module.file_sha256
    monkeypatch.setattr(cache_module, "file_sha256", lambda p: hashed.append(p) or real(p))
    first = model_identity(str(model_dir), model)
    assert model_identity(str(model_dir), model) == first and len(hashed) == 1
    assert not any(p.name.startswith("marslm") for p in model_dir.iterdir())  # nothing written beside the model


EXAMPLES = [{"input_ids": [1, 5, 6, 2], "labels": [IGNORE, 5, 6, 2]} for _ in range(16)]
ENCODED = {"examples": EXAMPLES, "truncated": 0, "dropped": 0}
BAD_ENCODINGS = {
    "empty-list": [],
    "empty-dict": {},
    "4-of-16": {**ENCODED, "examples": EXAMPLES[:4]},
    "missing-key": {"examples": EXAMPLES, "truncated": 0},
    "row-lengths": {**ENCODED, "examples": [{"input_ids": [1, 5], "labels": [IGNORE]}] + EXAMPLES[1:]},
    "out-of-vocab": {**ENCODED, "examples": [{"input_ids": [1, 999], "labels": [IGNORE, 999]}] + EXAMPLES[1:]},
}


@pytest.mark.parametrize("bad", list(BAD_ENCODINGS.values()), ids=list(BAD_ENCODINGS))
def test_a_data_cache_that_holds_the_wrong_thing_is_encoded_again(cache, caplog, bad):
    (cache / "tokenized").mkdir(parents=True)
    torch.save(bad, cache_dir() / "k.pt")
    with caplog.at_level(logging.WARNING, logger="marslm.train"):
        examples, _, _ = cached_encoding("k", lambda: (EXAMPLES, 0, 0), inputs=16, vocab_size=320)
    assert examples == EXAMPLES
    warnings = [r.getMessage() for r in caplog.records if "ignoring the cache" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert torch.load(cache_dir() / "k.pt", weights_only=True)["examples"] == EXAMPLES  # replaced


def _rows(lengths, k=2, vocab=320):
    return [
        {"teacher_ids": torch.full((n, k), vocab - 1, dtype=torch.int32), "teacher_probs": torch.full((n, k), 0.5)}
        for n in lengths
    ]


TEACHER_EXAMPLES = [{"input_ids": [1] * n, "labels": [IGNORE] * n} for n in [4, 5, 6, 7] * 4]
GOOD_ROWS = _rows([4, 5, 6, 7] * 4)
BAD_ROWS = {
    "4-of-16": GOOD_ROWS[:4],
    "3-short": _rows([1, 2, 3, 4] * 4),
    "rotated": GOOD_ROWS[1:] + GOOD_ROWS[:1],
    "missing-key": [{"teacher_ids": GOOD_ROWS[0]["teacher_ids"]}] + GOOD_ROWS[1:],
    "out-of-vocab": _rows([4, 5, 6, 7] * 4, vocab=321),
    "empty": [],
    "a-dict": {},
}


@pytest.mark.parametrize("bad", list(BAD_ROWS.values()), ids=list(BAD_ROWS))
def test_a_teacher_cache_that_holds_the_wrong_thing_is_computed_again(cache, caplog, bad):
    (cache / "tokenized").mkdir(parents=True)
    torch.save(bad, cache_dir() / "t.pt")
    with caplog.at_level(logging.WARNING, logger="marslm.train"):
        rows = cached("t", lambda: GOOD_ROWS, lambda v: teacher_problem(v, TEACHER_EXAMPLES, 2, 320))
    assert rows is GOOD_ROWS
    assert sum("ignoring the cache" in r.getMessage() for r in caplog.records) == 1
    assert teacher_problem(GOOD_ROWS, TEACHER_EXAMPLES, 2, 320) is None


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("file", "is a file; give a directory"),
        ("file/below", "is a file, not a directory"),
        ("/proc/marslm-cache", "/proc/marslm-cache: cannot create it in /proc"),
    ],
)
def test_an_unusable_cache_directory_is_refused_up_front(tiny_model_dir, tmp_path, monkeypatch, setting, fragment):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MARSLM_CACHE", setting if setting.startswith("/") else str(tmp_path / setting))
    out = tmp_path / "out"
    rc, _, err = run_cli("train", "mars", "--model", tiny_model_dir, "--data", "toy", "--data-n", 4, "-o", out)
    assert rc == 2 and fragment in err and "MARSLM_CACHE" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_a_rewritten_data_file_does_not_resume_the_old_run(tiny_model_dir, write_chat_jsonl, tmp_path, cache):
    data = write_chat_jsonl(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"
    cfg = TrainConfig(
        stage="ar",
        model=str(tiny_model_dir),
        data=str(data),
        output=str(out),
        max_steps=3,
        save_steps=1,
        batch_size=2,
        learning_rate=1e-3,
        progress=False,
    )
    with pytest.raises(Interrupted):
        train(cfg, callbacks=[interrupt_at(2)])
    write_chat_jsonl(data, 8, seed=5)  # the same path, other bytes
    with pytest.raises(UserError, match="holds checkpoints of a run on other data"):
        train(cfg)
    assert any((tmp_path / "out.partial").glob("checkpoint-*"))  # nothing discarded
    train(replace(cfg, overwrite=True))  # --overwrite starts afresh
    assert (out / "model.safetensors").is_file()
