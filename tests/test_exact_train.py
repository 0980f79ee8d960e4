"""``marslm train mars --exact`` and the masking options: what they accept, what they save, and
that an interrupted exact run resumes to the uninterrupted run's adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from marslm.adapter import FILENAME as ADAPTER_FILE
from marslm.errors import UserError
from marslm.mars_json import MarsConfig
from marslm.training.config import TrainConfig
from marslm.training.recipe import train
from tests.test_train_reliability import run_cli


@pytest.fixture
def data(write_chat_jsonl, tmp_path):
    return write_chat_jsonl(tmp_path / "d.jsonl", 12)


def _config(base, data, out, **options) -> TrainConfig:
    return TrainConfig(
        stage="mars",
        exact=True,
        model=str(base),
        data=str(data),
        output=str(out),
        max_steps=options.pop("max_steps", 4),
        batch_size=4,
        learning_rate=1e-2,
        progress=False,
        save_steps=options.pop("save_steps", 100),
        **options,
    )


@pytest.mark.parametrize(
    "options, rows, rank, linears",
    [
        ({}, 4, 32, 14),
        ({"mask_rows": "shared", "lora_rank": 0}, 1, 0, 0),
        ({"lora_rank": 4, "block_size": 3}, 3, 4, 14),
        ({"lora_modules": ["q_proj", "v_proj"]}, 4, 32, 4),  # two of each layer's seven
    ],
)
def test_the_checkpoint_records_the_adapter_it_trained(tiny_model_dir, data, tmp_path, options, rows, rank, linears):
    out = tmp_path / "out"
    summary = train(_config(tiny_model_dir, data, out, random_phase=True, masked_streams=2, **options))
    config = MarsConfig.load(out)
    assert config.exact and config.adapter["rows"] == rows and config.adapter["rank"] == rank
    saved = load_file(str(out / ADAPTER_FILE))
    assert saved["rows"].shape[0] == rows
    assert len([k for k in saved if k.startswith("lora.")]) == 2 * linears
    assert len(config.adapter["targets"]) == linears
    if "lora_modules" in options:
        assert {t.rsplit(".", 1)[-1] for t in config.adapter["targets"]} == set(options["lora_modules"])
    assert not any(k.startswith("mars_adapter") for k in load_file(str(out / "model.safetensors")))
    assert (out / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert summary.parameters == sum(t.numel() for t in load_file(str(out / "model.safetensors")).values())


def test_a_lora_module_the_model_lacks_is_refused_in_one_line(tiny_model_dir, data, tmp_path):
    with pytest.raises(UserError, match="no Linear called 'qkv_proj' \\(they have down_proj, ") as refused:
        train(_config(tiny_model_dir, data, tmp_path / "out", lora_modules=["q_proj", "qkv_proj"]))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_an_interrupted_exact_run_resumes_to_the_same_adapter(tiny_model_dir, data, tmp_path):
    from transformers import TrainerCallback

    class Stop(Exception):
        pass

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise Stop

    common = dict(max_steps=5, save_steps=2, random_phase=True, masked_streams=2, offset_decay=0.8)
    train(_config(tiny_model_dir, data, tmp_path / "whole", **common))
    with pytest.raises(Stop):
        train(_config(tiny_model_dir, data, tmp_path / "cut", **common), callbacks=[StopAt()])
    assert (tmp_path / "cut.partial" / "checkpoint-2").is_dir()
    train(_config(tiny_model_dir, data, tmp_path / "cut", **common))
    whole, cut = (load_file(str(tmp_path / run / ADAPTER_FILE)) for run in ("whole", "cut"))
    assert whole.keys() == cut.keys()
    for key in whole:
        torch.testing.assert_close(cut[key], whole[key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--exact", "--mask-only"], "--exact keeps the model frozen and trains only its adapter: drop --mask-only"),
        (["--exact", "--train-layers", "2"], "drop --train-layers"),
        (["--exact", "--soft-clean", "1"], "drop --soft-clean"),
        (["--exact", "--gradient-checkpointing"], "drop --gradient-checkpointing"),
        (["--exact", "--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--lora-rank", "0"], "--lora-rank must be >= 1"),
        (["--masked-streams", "0"], "--masked-streams must be >= 1"),
        (["--offset-decay", "1.5"], "--offset-decay must be <= 1"),
        (["--offset-decay", "nan"], "--offset-decay must be a finite number"),
    ],
)
def test_bad_exact_and_masking_options_are_refused(tmp_path, flags, message):
    rc, _, stderr = run_cli(
        "train", "mars", "--model", tmp_path / "m", "--data", "toy", "-o", tmp_path / "o", "--quiet", *flags
    )
    assert rc == 2 and message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags", [["--exact"], ["--random-phase"], ["--masked-streams", "2"]])
def test_the_masking_options_are_for_stage_mars(tmp_path, flags):
    rc, _, stderr = run_cli(
        "train", "ar", "--model", tmp_path / "m", "--data", "toy", "-o", tmp_path / "o", "--quiet", *flags
    )
    assert rc == 2 and "is for stage mars" in stderr, stderr


def test_the_help_explains_exact_mode(capsys):
    from marslm import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "mars", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--exact", "--mask-rows", "--random-phase", "--masked-streams", "--offset-decay"):
        assert flag in text
    assert "by construction" in text


def test_probe_reads_an_exact_checkpoint(trained_dirs, tmp_path):
    """The probe loads the adapter: the clean stream is the original's (same agreement with the
    references, same cross-entropy), and the masks draft."""
    from marslm.data import toy

    data = tmp_path / "probe.jsonl"
    with data.open("w") as f:
        for ex in toy.make_split("train", 8, seed=0):
            f.write(json.dumps(toy.to_chat_record(ex)) + "\n")
    reports = {}
    for run in ("ar", "exact"):
        out = tmp_path / f"{run}.json"
        rc, _, stderr = run_cli("probe", "--model", trained_dirs["dir"] / run, "--data", data, "--out", out)
        assert rc == 0, stderr
        reports[run] = json.loads(out.read_text())
    assert reports["exact"]["fidelity"] == reports["ar"]["fidelity"]
    assert reports["exact"]["clean_ce"] == pytest.approx(reports["ar"]["clean_ce"], rel=1e-5)
    assert reports["exact"]["tokens_per_forward_lossless_tf"] > reports["ar"]["tokens_per_forward_lossless_tf"]
