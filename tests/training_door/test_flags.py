"""Rules 3, 4, 6 and 7 of issue 36 for ``marslm train``: every number is bounded by what it means
before any work, a flag the others make idle is named in one line, the checkpoint records the
parameters it holds, and a LoRA run prints no library noise."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

from marslm.errors import UserError
from marslm.training.config import TrainConfig
from tests.test_train_reliability import run_cli


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--teacher-top-k", "100000"], "--teacher-top-k must be <= "),
        (["--teacher-top-k", str(2**70)], "--teacher-top-k must be <= "),
        (["--lora-rank", "1000000000"], "--lora-rank must be <= 64 (its hidden size)"),
        (["--vocab-multiple", "1000000000"], "--vocab-multiple must be <= "),
        (["--block-size", "1000000000"], "--block-size must be <= 1,024 (the model's positions)"),
        (["--block-size", "2048"], "--block-size must be <= 1,024 (the model's positions), got 2,048"),
        (["--max-steps", "-5"], "--max-steps must be >= 1, or -1 to run the epochs; got -5"),
        (["--epochs", "-2", "--max-steps", "5"], "--epochs must be >= 0, got -2"),
        (["--masked-streams", "9", "--block-size", "4"], "--masked-streams must be <= --block-size 4"),
    ],
)
def test_numbers_beyond_what_they_mean_are_refused_before_training(tiny_model_dir, tmp_path, flags, message):
    out = tmp_path / "out"
    rc, _, err = run_cli(
        "train", "mars", "--model", tiny_model_dir, "--data", "toy", "--data-n", 4, "-o", out, "--quiet", *flags
    )
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no out/, no out.partial/


def test_more_toy_examples_than_the_generator_makes_are_refused(tmp_path):
    """Checked on the config alone: without the bound, the run would hang generating them."""
    cfg = TrainConfig(stage="mars", model="m", data="toy", output=str(tmp_path / "o"), data_n=10**12)
    with pytest.raises(UserError, match=r"--data-n must be in 1\.\.1000000, got 1000000000000"):
        cfg.validate()


@pytest.mark.parametrize("flag, value", [("block_size", 8), ("ar_weight", 0.5), ("masked_weighting", "inverse-t"),
                                         ("vocab_multiple", 8)])  # fmt: skip
def test_stage_ar_refuses_what_only_stage_mars_reads(tmp_path, flag, value):
    cfg = TrainConfig(stage="ar", model="m", data="toy", output=str(tmp_path / "o"), **{flag: value})
    with pytest.raises(UserError, match=f"--{flag.replace('_', '-')} is for stage mars"):
        cfg.validate()


def _distill(path, unfinished: bool = False):
    from marslm.data.distilled import unfinished_path

    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path.write_text(json.dumps({"id": "p0", "messages": messages, "answer_ids": [20], "finished": True}) + "\n")
    if unfinished:
        unfinished_path(path).write_text("")
    return path


def _chat(path):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    return path


IDLE = {
    "lora-alpha-without-rank": (dict(lora_alpha=8.0), "--lora-alpha does nothing without a --lora-rank"),
    "lora-alpha-exact-rank-0": (dict(exact=True, lora_rank=0, lora_alpha=8.0), "--lora-alpha does nothing"),
    "lora-modules-without-rank": (dict(lora_modules=["q_proj"]), "--lora-modules does nothing without a --lora-rank"),
    "cut-answers-on-chat": (dict(data="chat", cut_answers=True), "--cut-answers does nothing: "),
    "cut-answers-on-toy": (dict(cut_answers=True), "--cut-answers does nothing: toy is not"),
    "cut-answers-retokenize": (dict(data="distill+", cut_answers=True, answer_ids=False), "with --retokenize"),
    "cut-answers-no-unfinished": (dict(data="distill", cut_answers=True), "there is no "),
    "teacher-top-k-without-soft": (dict(teacher_top_k=4), "--teacher-top-k does nothing without --soft-clean"),
    "data-seed-with-a-file": (dict(data="chat", data_seed=3), "--data-seed does nothing with a data file"),
    "retokenize-on-chat": (dict(data="chat", answer_ids=False), "--retokenize does nothing: "),
    "freeze-with-train-layers": (dict(freeze_embeddings=True, train_layers=1), "--freeze-embeddings does nothing"),
    "mask-rows-without-exact": (dict(mask_rows="shared"), "--mask-rows does nothing without --exact"),
    "exact-ar-weight": (dict(exact=True, ar_weight=0.5), "--ar-weight does nothing with --exact"),
    "exact-vocab-multiple": (dict(exact=True, vocab_multiple=8), "--vocab-multiple does nothing with --exact"),
}


@pytest.mark.parametrize("settings, warning", list(IDLE.values()), ids=list(IDLE))
def test_a_flag_the_others_make_idle_is_named_in_one_line(tmp_path, settings, warning):
    data = {
        "chat": lambda: _chat(tmp_path / "chat.jsonl"),
        "distill": lambda: _distill(tmp_path / "d.jsonl"),
        "distill+": lambda: _distill(tmp_path / "d.jsonl", unfinished=True),
    }
    settings = dict(settings)
    if settings.get("data") in data:
        settings["data"] = str(data[settings["data"]]())
    cfg = TrainConfig(**{"stage": "mars", "model": "m", "data": "toy", "output": str(tmp_path / "o"), **settings})
    cfg.validate()  # a warning, not a refusal
    lines = cfg.idle_flags()
    assert len(lines) == 1 and warning in lines[0] and "\n" not in lines[0], lines


def test_flags_that_all_do_something_warn_of_nothing(tmp_path):
    cfg = TrainConfig(
        stage="mars",
        model="m",
        data=str(_distill(tmp_path / "d.jsonl", unfinished=True)),
        output=str(tmp_path / "o"),
        cut_answers=True,
        lora_rank=4,
        lora_alpha=8.0,
        soft_clean=0.5,
        teacher_top_k=4,
        train_layers=1,
    )
    cfg.validate()
    assert cfg.idle_flags() == []


def test_an_idle_flag_is_warned_about_in_the_run_and_leaves_an_error_one_line(tiny_model_dir, tmp_path):
    """In a real process (logging to stderr): a run warns, and a refusal prints no warning before it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.getcwd())
    common = [sys.executable, "-m", "marslm.cli", "train", "mars", "--model", str(tiny_model_dir), "--data", "toy"]
    common += ["--data-n", "4", "--max-steps", "1", "--batch-size", "2", "--quiet", "--data-seed", "0"]
    refused = subprocess.run(
        [*common, "-o", str(tmp_path / "a"), "--teacher-top-k", "100000"], capture_output=True, text=True, env=env
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--teacher-top-k must be <= " in refused.stderr
    warned = subprocess.run(
        [*common, "-o", str(tmp_path / "b"), "--teacher-top-k", "8"], capture_output=True, text=True, env=env
    )
    assert warned.returncode == 0, warned.stderr[-2000:]
    assert "marslm: --teacher-top-k does nothing without --soft-clean or --soft-masked\n" in warned.stderr


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """One LoRA run through the CLI: (exit status, stdout, stderr, warnings raised, log lines, output)."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    data = root / "d.jsonl"
    from tests.helpers import write_chat_jsonl_file

    write_chat_jsonl_file(data, 4)
    out = root / "out"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("marslm.train").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rc, stdout, err = run_cli(
                "train", "mars", "--model", tiny_model_dir, "--data", data, "-o", out, "--max-steps", 1,
                "--batch-size", 2, "--lora-rank", 4, "--quiet",
            )  # fmt: skip
    finally:
        logging.getLogger("marslm.train").removeHandler(handler)
    return rc, stdout, err, [str(w.message) for w in caught], [r.getMessage() for r in records], out


def test_a_lora_checkpoint_records_the_parameters_it_holds(lora_run):
    from safetensors.torch import load_file

    rc, stdout, err, _, _, out = lora_run
    assert rc == 0, err
    saved = load_file(str(out / "model.safetensors"))
    held = sum(t.numel() for name, t in saved.items() if name != "lm_head.weight")  # tied: counted once
    recorded = json.loads((out / "marslm.json").read_text())["extra"]["train"]["parameters"]
    assert recorded == held and f"{held:,} parameters" in stdout


def test_a_lora_run_with_spare_rows_claims_no_new_embedding_row(lora_run):
    _, _, _, _, log_lines, _ = lora_run
    assert not [line for line in log_lines if "needed a new embedding row" in line], log_lines


def test_a_lora_run_prints_no_library_warning(lora_run):
    _, _, err, caught, _, _ = lora_run
    assert not [w for w in caught if "is_gradient_checkpointing" in w], caught
    assert "FutureWarning" not in err
