"""Training survives ``kill -9`` anywhere, refuses bad hyperparameters up front, and stops on a
loss that is no longer finite instead of saving garbage.

The kill test runs the real CLI in child processes that SIGKILL themselves at chosen points of
a checkpoint write (hooks patched in from outside the package), reruns the same command after
each kill, and requires the final weights to equal an uninterrupted run's bit for bit."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from marslm import cli
from marslm.errors import UserError
from marslm.training.checkpoints import (
    CHECKPOINT_MARKER,
    RUN_SETTINGS,
    NonFiniteTraining,
    checkpoint_is_complete,
    may_resume,
)
from marslm.training.config import TrainConfig
from marslm.training.recipe import train

# Patches Trainer (or marslm) so that the process SIGKILLs itself at POINT when the global step is
# STEP, then runs `marslm ARGS...`. argv: POINT STEP ARGS...
KILL_HOOK = r"""
import os, signal, sys
point, step = sys.argv[1], int(sys.argv[2])

def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)

from transformers import Trainer
import marslm.training.trainer as trainer_module
from marslm.mars_json import MarsConfig

def wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)
    def wrapper(self, *args, **kwargs):
        if before and self_at(self):
            before(self, *args, **kwargs)
        out = original(self, *args, **kwargs)
        if after and self_at(self):
            after(self, *args, **kwargs)
        return out
    setattr(owner, name, wrapper)

def self_at(self):
    return not hasattr(self, "state") or self.state.global_step == step

def make_empty_dir(self, output_dir=None, _internal_call=False):
    if _internal_call:
        os.makedirs(output_dir, exist_ok=True)
        die()

hooks = {
    "before-save": lambda: wrap(trainer_module.CrashSafeCheckpoints, "_save_checkpoint", before=die),
    "empty-dir": lambda: wrap(Trainer, "save_model", before=make_empty_dir),
    "weights-without-state": lambda: wrap(Trainer, "_save_rng_state", before=die),
    "state-without-marker": lambda: wrap(Trainer, "_save_checkpoint", after=die),
    "after-save": lambda: wrap(trainer_module.CrashSafeCheckpoints, "_save_checkpoint", after=die),
    "final-dir": lambda: wrap(MarsConfig, "save", before=die),
    "none": lambda: None,
}
hooks[point]()
from marslm.cli import main
sys.exit(main(sys.argv[3:]))
"""


def run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, tiny_tokenizer, make_tiny_model):
    path = tmp_path_factory.mktemp("base")
    make_tiny_model("qwen2", "sdpa", seed=0).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_kill_9_anywhere_then_rerun_gives_the_uninterrupted_weights(base_model, write_chat_jsonl, tmp_path):
    data = write_chat_jsonl(tmp_path / "data.jsonl", 32)  # 8 steps an epoch: step 6 ends none
    hook = tmp_path / "hook.py"
    hook.write_text(KILL_HOOK)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    common = [
        "train",
        "mars",
        "--model",
        base_model,
        "--data",
        data,
        "--max-steps",
        6,
        "--save-steps",
        2,
        "--batch-size",
        4,
        "--lr",
        1e-3,
        "--logging-steps",
        1,
        "--quiet",
    ]

    def run(point: str, step: int, out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(hook), point, str(step), *map(str, common), "-o", str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    reference = run("none", 0, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-2000:]

    out, partial = tmp_path / "out", tmp_path / "out.partial"
    # (kill point, step, what the checkpoint directory holds afterwards)
    kills = [
        ("empty-dir", 2, {"checkpoint-2": "incomplete"}),  # the probe's "Can't find a valid checkpoint"
        ("weights-without-state", 2, {"checkpoint-2": "incomplete"}),  # the probe's FileNotFoundError
        ("before-save", 4, {"checkpoint-2": "complete"}),
        ("after-save", 4, {"checkpoint-2": "complete", "checkpoint-4": "complete"}),
        ("state-without-marker", 6, {"checkpoint-4": "complete", "checkpoint-6": "incomplete"}),
        ("final-dir", 6, {"checkpoint-4": "complete", "checkpoint-6": "complete", "final": "incomplete"}),
    ]
    for point, step, expected in kills:
        killed = run(point, step, out)
        assert killed.returncode == -9, (point, killed.stderr[-2000:])
        assert not out.exists()
        found = {
            p.name: "complete" if checkpoint_is_complete(p) else "incomplete"
            for p in partial.iterdir()
            if p.name != RUN_SETTINGS
        }
        assert found == expected, point

    finished = run("none", 0, out)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "Traceback" not in finished.stderr
    assert ", 6 steps," in finished.stdout  # not 7: the last checkpoint was not trained on
    assert not partial.exists()
    got, want = weights(out), weights(tmp_path / "reference")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_completeness_is_the_marker_and_the_sizes(tmp_path):
    from marslm.training.checkpoints import mark_checkpoint_complete, resume_point

    partial = tmp_path / "out.partial"
    for step in (2, 4, 6):
        (partial / f"checkpoint-{step}").mkdir(parents=True)
        (partial / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x" * 100)
        (partial / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    mark_checkpoint_complete(partial / "checkpoint-2")
    mark_checkpoint_complete(partial / "checkpoint-4")
    (partial / "checkpoint-4" / "model.safetensors").write_bytes(b"x" * 50)  # truncated after the fact
    (partial / "final").mkdir()
    assert resume_point(partial, resume=True) == partial / "checkpoint-2"
    assert sorted(p.name for p in partial.iterdir()) == ["checkpoint-2"]
    assert (partial / "checkpoint-2" / CHECKPOINT_MARKER).is_file()
    assert resume_point(partial, resume=False) is None and not partial.exists()


def test_a_checkpoint_damaged_in_place_is_not_resumed(tmp_path):
    """Same size, other bytes: the marker's hashes catch it before any file is loaded."""
    from marslm.training.checkpoints import mark_checkpoint_complete, resume_point

    partial = tmp_path / "out.partial"
    for step in (2, 4):
        (partial / f"checkpoint-{step}").mkdir(parents=True)
        (partial / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x" * 100)
        mark_checkpoint_complete(partial / f"checkpoint-{step}")
    (partial / "checkpoint-4" / "model.safetensors").write_bytes(b"y" * 100)
    assert resume_point(partial, resume=True) == partial / "checkpoint-2"
    assert sorted(p.name for p in partial.iterdir()) == ["checkpoint-2"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "nan"], "--learning-rate must be a finite number"),
        (["--lr", "-1"], "--learning-rate must be > 0"),
        (["--lr", "inf"], "--learning-rate must be a finite number"),
        (["--ar-weight", "nan"], "--ar-weight must be a finite number"),
        (["--ar-weight", "-1"], "--ar-weight must be >= 0"),
        (["--warmup-ratio", "5"], "--warmup-ratio must be < 1"),
        (["--warmup-ratio", "-0.1"], "--warmup-ratio must be >= 0"),
        (["--save-steps", "0"], "--save-steps must be >= 1"),
        (["--save-steps", "-5"], "--save-steps must be >= 1"),
        (["--data-n", "0"], "--data-n must be >= 1"),
        (["--data-n", "-3"], "--data-n must be >= 1"),
        (["--epochs", "nan"], "--epochs must be a finite number"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
        (["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
        (["--seed", str(2**32)], "--seed must be in 0..4294967295"),
    ],
)
def test_bad_hyperparameters_are_refused_before_training(tmp_path, flags, message):
    out = tmp_path / "out"
    rc, stdout, stderr = run_cli(
        "train",
        "mars",
        "--model",
        tmp_path / "no-model-needed",
        "--data",
        "toy",
        "-o",
        out,
        "--max-steps",
        2,
        "--quiet",
        *flags,
    )
    assert rc == 2 and message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []  # no out/, no out.partial/


def poison_at(step: int, when: str = "step_end"):
    """A callback that sets one weight to NaN at the end of ``step``."""
    from transformers import TrainerCallback

    class _Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == step:
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("nan")

    return _Poison()


@pytest.mark.parametrize(
    "poisoned_step, reason", [(3, "the loss became nan at step 4"), (4, "is not finite after step 4")]
)
def test_a_non_finite_run_stops_without_saving_garbage(base_model, write_chat_jsonl, tmp_path, poisoned_step, reason):
    """Poisoned after step 3: step 4's loss is NaN. Poisoned at step 4: the checkpoint due then is refused."""
    data = write_chat_jsonl(tmp_path / "data.jsonl", 16)
    cfg = TrainConfig(
        stage="ar",
        model=str(base_model),
        data=str(data),
        output=str(tmp_path / "out"),
        max_steps=8,
        save_steps=2,
        batch_size=2,
        learning_rate=1e-3,
        progress=False,
    )
    with pytest.raises(NonFiniteTraining, match=reason):
        train(cfg, callbacks=[poison_at(poisoned_step)])
    partial = tmp_path / "out.partial"
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in partial.iterdir()) == ["checkpoint-2", RUN_SETTINGS]
    assert all(torch.isfinite(t).all() for t in weights(partial / "checkpoint-2").values())
    log = json.loads((partial / "checkpoint-2" / "trainer_state.json").read_text())
    assert log["global_step"] == 2


class Interrupted(Exception):
    pass


def interrupt_at(step: int):
    from transformers import TrainerCallback

    class _Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise Interrupted

    return _Interrupt()


def test_checkpoints_are_resumed_only_by_the_run_they_belong_to(base_model, write_chat_jsonl, tmp_path, caplog):
    data, other_data = write_chat_jsonl(tmp_path / "data.jsonl", 8), write_chat_jsonl(tmp_path / "other.jsonl", 8)
    out = tmp_path / "out"
    cfg = TrainConfig(
        stage="ar",
        model=str(base_model),
        data=str(data),
        output=str(out),
        max_steps=3,
        save_steps=1,
        batch_size=2,
        learning_rate=1e-3,
        progress=False,
    )
    with pytest.raises(Interrupted):  # killed after its first checkpoint
        train(cfg, callbacks=[interrupt_at(2)])
    partial = tmp_path / "out.partial"
    left = sorted(p.name for p in partial.iterdir())
    assert "checkpoint-1" in left

    run = ["train", "ar", "--model", base_model, "-o", out, "--batch-size", 2, "--save-steps", 1, "--quiet"]
    same = ["--data", data, "--lr", 1e-3, "--max-steps", 3]
    for changed, difference in (
        (["--data", other_data, "--lr", 1e-3, "--max-steps", 3], f"--data {str(data)!r}, not {str(other_data)!r}"),
        (["--data", data, "--lr", 2e-3, "--max-steps", 3], "--learning-rate 0.001, not 0.002"),
        (["--data", data, "--lr", 1e-3, "--max-steps", 5], "--max-steps 3, not 5"),
    ):
        rc, _, err = run_cli(*run, *changed)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert difference in err and "--no-resume" in err and "--overwrite" in err, err
        assert sorted(p.name for p in partial.iterdir()) == left  # nothing deleted
    assert may_resume(replace(cfg, learning_rate=2e-3, overwrite=True)) is False  # --overwrite: start afresh
    assert may_resume(replace(cfg, logging_steps=1, progress=True)) is True  # what does not change the run
    recorded = (partial / RUN_SETTINGS).read_text()
    (partial / RUN_SETTINGS).unlink()  # checkpoints of unknown origin
    with pytest.raises(UserError, match="settings were not recorded; pass --no-resume"):
        may_resume(cfg)
    (partial / RUN_SETTINGS).write_text(recorded)

    with caplog.at_level(logging.WARNING, logger="marslm.train"):
        rc, stdout, err = run_cli(*run, *same, "--logging-steps", 1)
    assert rc == 0 and ", 3 steps," in stdout, err
    assert "resuming from" in caplog.text and "checkpoint-" in caplog.text
