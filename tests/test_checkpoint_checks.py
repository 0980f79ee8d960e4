"""An exact checkpoint is proved before it is used, and every fact ``marslm.json`` records is checked
once: what the CLI, the server's start and ``marslm.load`` refuse in one line (or warn about).

The checkpoints are a tiny random model plus an adapter with random (non-zero) weights, built in a
fraction of a second: these are checks of files, not of training.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import marslm
from marslm import adapter as adapter_mod
from marslm.adapter import FILENAME as ADAPTER_FILE
from marslm.adapter import MaskAdapter
from marslm.adapter_proof import base_fingerprint
from marslm.errors import UserError
from marslm.mars_json import MarsConfig
from tests.cli.test_errors import assert_one_line_error, run

BLOCK = 4


@pytest.fixture(scope="module")
def exact_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """An exact checkpoint of the tiny model: its files, an adapter, and the record training writes."""
    model, tokenizer = marslm.load(str(tiny_model_dir))
    mask_id = model.get_input_embeddings().weight.shape[0]  # past the last row, as exact training picks
    adapter = MaskAdapter.for_model(model, mask_id, rank=4, rows=BLOCK)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    adapter.attach(model)
    out = tmp_path_factory.mktemp("exact")
    adapter_mod.save_checkpoint(model, tokenizer, str(tiny_model_dir), out)
    record = MarsConfig(stage="mars", block_size=BLOCK, mask_token_id=mask_id, adapter=adapter.spec.to_dict())
    record.save(out)
    return out


@pytest.fixture
def damaged(exact_dir, tmp_path):
    """``damaged(record=None, tensors=None, adapter_bytes=None)``: a copy of ``exact_dir`` with its
    marslm.json changed by ``record(dict)``, its adapter's tensors by ``tensors(dict)``, or its
    adapter file replaced by ``adapter_bytes`` (None: removed)."""

    def make(record=None, tensors=None, **replace) -> Path:
        path = tmp_path / "checkpoint"
        shutil.copytree(exact_dir, path)
        if record is not None:
            raw = json.loads((path / "marslm.json").read_text())
            record(raw)
            (path / "marslm.json").write_text(json.dumps(raw))
        if tensors is not None:
            weights = load_file(str(path / ADAPTER_FILE))
            tensors(weights)
            save_file(weights, str(path / ADAPTER_FILE))
        if "adapter_bytes" in replace:
            if replace["adapter_bytes"] is None:
                (path / ADAPTER_FILE).unlink()
            else:
                (path / ADAPTER_FILE).write_bytes(replace["adapter_bytes"])
        return path

    return make


def refused(path, *fragments: str) -> str:
    """``marslm.load`` refuses ``path`` with a UserError holding every fragment; returns its text."""
    with pytest.raises(UserError) as err:
        marslm.load(str(path))
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


def cli_refuses(capsys, path, fragment: str) -> None:
    """``marslm generate`` refuses ``path`` in one line holding ``fragment``."""
    capsys.readouterr()  # what loading printed before the CLI quieted the libraries
    rc, out, err = run(capsys, "generate", "--model", path, "--prompt", "hi", "--max-new-tokens", 2, "--tau", 1)
    assert_one_line_error(rc, err, fragment)
    assert out == ""


def test_the_checkpoint_loads_in_another_dtype(exact_dir):
    """The guard of the checks below: the intact checkpoint loads in every float dtype (the base
    weights' fingerprint was recorded for each)."""
    for dtype in (None, torch.bfloat16, torch.float16, torch.float64):
        model, _ = marslm.load(str(exact_dir), dtype=dtype)
        assert adapter_mod.adapter_of(model) is not None


# --- rule 2: an adapter is proved before it is used ------------------------------------------


@pytest.mark.parametrize("how", ["truncated", "empty"])
def test_an_unreadable_adapter_file_is_one_line_naming_it(exact_dir, damaged, capsys, how):
    data = (exact_dir / ADAPTER_FILE).read_bytes()
    path = damaged(adapter_bytes=data[: len(data) // 2] if how == "truncated" else b"")
    refused(path, f"{path / ADAPTER_FILE} is not a readable adapter file")
    cli_refuses(capsys, path, "is not a readable adapter file")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["rows", "lora.0.a", "lora.3.b"])
def test_an_adapter_with_a_value_that_is_not_finite_is_refused(damaged, value, where):
    def spoil(tensors):
        tensors[where].view(-1)[0] = value

    refused(damaged(tensors=spoil), f"tensor {where} holds NaN or infinite values")


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda t: t.update(rows=t["rows"][:2].clone()), "tensor rows has shape (2, 64)"),
        (lambda t: t.pop("lora.0.a"), "has no tensor lora.0.a"),
        (lambda t: t.update(extra=torch.zeros(2)), "holds a tensor extra"),
    ],
)
def test_an_adapter_whose_tensors_are_not_the_specs_is_refused(damaged, change, fragment):
    refused(damaged(tensors=change), fragment)


def test_an_adapter_trained_on_other_base_weights_is_refused(damaged, make_tiny_model, tiny_model_dir):
    path = damaged()
    make_tiny_model(seed=5).save_pretrained(path)  # the same shapes, other weights
    recorded = json.loads((path / "marslm.json").read_text())["adapter"]["base_fingerprint"]
    original, _ = marslm.load(str(tiny_model_dir))
    assert base_fingerprint(original) == ("float32", recorded["float32"])
    message = refused(path, "trained on other base weights", recorded["float32"], "read in float32")
    assert message.count("sha256:") == 2


def test_an_adapter_without_a_recorded_fingerprint_loads_with_a_warning(damaged, caplog):
    path = damaged(record=lambda raw: raw["adapter"].pop("base_fingerprint"))
    with caplog.at_level(logging.WARNING, logger="marslm"):
        model, _ = marslm.load(str(path))
    assert adapter_mod.adapter_of(model) is not None
    assert "records no fingerprint of the base weights" in caplog.text


def test_exact_training_records_the_fingerprint_of_its_base(tiny_model_dir, write_chat_jsonl, tmp_path):
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    data = write_chat_jsonl(tmp_path / "d.jsonl", 8)
    out = tmp_path / "out"
    settings = dict(stage="mars", exact=True, lora_rank=2, max_steps=1, batch_size=4, progress=False)
    train(TrainConfig(model=str(tiny_model_dir), data=str(data), output=str(out), **settings))
    recorded = MarsConfig.load(out).adapter["base_fingerprint"]
    for dtype in ("float32", "bfloat16", "float16"):
        original, _ = marslm.load(str(tiny_model_dir), dtype=getattr(torch, dtype))
        assert base_fingerprint(original) == (dtype, recorded[dtype])


@pytest.mark.parametrize(
    "how, fragment",
    [
        ("entry-without-file", f"describes an adapter, but {ADAPTER_FILE} is missing"),
        ("file-without-entry", f"has no adapter entry, but {ADAPTER_FILE} is beside it"),
        ("file-without-record", f"holds {ADAPTER_FILE} but no marslm.json"),
    ],
)
def test_marslm_json_and_the_adapter_file_agree(damaged, capsys, how, fragment):
    if how == "entry-without-file":
        path = damaged(adapter_bytes=None)
    elif how == "file-without-entry":
        path = damaged(record=lambda raw: raw.update(adapter=None))
    else:
        path = damaged()
        (path / "marslm.json").unlink()
    refused(path, fragment)
    cli_refuses(capsys, path, fragment)


# --- rule 3: marslm.json is read through one validator --------------------------------------


def _set(key, value, in_adapter=False):
    return lambda raw: (raw["adapter"] if in_adapter else raw).update({key: value})


@pytest.mark.parametrize(
    "record, fragment",
    [
        (_set("mask_token_id", 2**64), "mask_token_id 18446744073709551616 differs from the adapter's"),
        (_set("mask_token_id", 10**6, True), "adapter.mask_token_id must be an integer in 0..320"),
        (_set("mask_token_id", -1), "mask_token_id must be an integer >= 0"),
        (_set("block_size", 10**9), "block_size must be an integer in 1..1024 (the model's context)"),
        (_set("block_size", 0), "block_size must be an integer in 1..1024"),
        (_set("block_size", True), "block_size must be an integer in 1..1024 (the model's context), got True"),
        (_set("rank", "8", True), "adapter.rank must be an integer in 0..64 (at most the hidden size), got '8'"),
        (_set("rank", 10**9, True), "adapter.rank must be an integer in 0..64"),
        (_set("hidden_size", 10**12, True), "adapter.hidden_size 1000000000000 is not the model's hidden size 64"),
        (_set("rows", 10**9, True), "adapter.rows must be 1 or the block size 4, got 1000000000"),
        (_set("rows", False, True), "adapter.rows must be an integer >= 1, got False"),
        (_set("alpha", float("inf"), True), "adapter.alpha must be a finite number > 0"),
        (_set("targets", "model.layers.0.mlp.up_proj", True), "adapter.targets must be a list of Linear names"),
        (_set("stage", "exact"), "stage must be one of ar, mars"),
        (_set("ar_weight", "1"), "ar_weight must be a finite number"),
        (lambda raw: raw["adapter"].pop("rank"), "the adapter entry has no rank"),
        (_set("adapter", [1, 2]), "adapter must be a JSON object, got list"),
    ],
)
def test_a_record_out_of_type_or_bounds_is_one_line_before_anything_loads(damaged, monkeypatch, record, fragment):
    from transformers import AutoModelForCausalLM

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights loaded before marslm.json was checked")

    path = damaged(record=record)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    refused(path, "marslm.json: ", fragment)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--tau", 1], ["serve", "--port", 0]])
def test_the_cli_and_the_servers_start_refuse_a_bad_record_in_one_line(damaged, capsys, command):
    path = damaged(record=_set("block_size", 10**9))
    capsys.readouterr()
    rc, out, err = run(capsys, command[0], "--model", path, *command[1:])
    assert_one_line_error(rc, err, "block_size must be an integer in 1..1024 (the model's context)")
    assert "listening" not in out


def test_unknown_keys_are_named_in_a_warning(damaged, caplog):
    path = damaged(record=lambda raw: raw.update(blok_size=3) or raw["adapter"].update(ranks=2))
    with caplog.at_level(logging.WARNING, logger="marslm"):
        marslm.load(str(path))
    assert "unknown keys in the marslm.json, ignored: blok_size" in caplog.text
    assert "unknown keys in the adapter entry, ignored: ranks" in caplog.text


def test_a_full_checkpoints_mask_id_must_be_a_row_of_its_embedding(tiny_model_dir, tmp_path):
    path = tmp_path / "full"
    shutil.copytree(tiny_model_dir, path)
    MarsConfig(stage="mars", mask_token_id=320).save(path)  # one past the last row: only an adapter embeds it
    refused(path, "mask_token_id 320, outside the model's vocabulary (0..319)")


# --- rule 5: the leftovers, one line each ---------------------------------------------------------


def test_train_into_proc_is_one_line(tiny_model_dir, capsys):
    rc, _, err = run(capsys, "train", "ar", "--model", tiny_model_dir, "--data", "toy", "-o", "/proc/marslm-out")
    assert_one_line_error(rc, err, "--output /proc/marslm-out: cannot create it in /proc")


def test_a_lora_alpha_past_any_rank_is_one_line(tiny_model_dir, capsys, tmp_path):
    args = ["--model", tiny_model_dir, "--data", "toy", "-o", tmp_path / "o", "--lora-rank", 2, "--lora-alpha", 1e308]
    rc, _, err = run(capsys, "train", "ar", *args)
    assert_one_line_error(rc, err, "--lora-alpha must be <= 65536, got 1e+308")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_a_folder_with_only_a_config_is_not_a_checkpoint(tiny_model_dir, tmp_path, capsys, command):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    rc, _, err = run(capsys, command[0], "--model", tmp_path, *command[1:])
    assert_one_line_error(rc, err, f"{tmp_path} is not a checkpoint: it has a config.json but no weights")
