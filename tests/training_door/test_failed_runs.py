"""A failed run leaves nothing behind, and two runs into one output are refused (issue 36, rule 5)."""

from __future__ import annotations

import pytest

from marslm.errors import UserError
from marslm.training.checkpoints import one_run_per_output, partial_dir_of
from marslm.training.config import TrainConfig
from marslm.training.recipe import train


def tiny_run(model_dir, output) -> TrainConfig:
    return TrainConfig(
        stage="mars",
        model=str(model_dir),
        data="toy",
        data_n=4,
        data_seed=0,
        max_steps=2,
        batch_size=2,
        save_steps=1,
        output=str(output),
        progress=False,
    )


def test_a_second_run_into_the_same_output_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    with one_run_per_output(str(out)):  # the first run, still training
        with pytest.raises(UserError, match=f"another run is training into {out}"):
            train(tiny_run(tiny_model_dir, out))
    assert not partial_dir_of(str(out)).exists() and not out.exists()


def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch):
    from marslm.training import recipe

    def fail(trainer, checkpoint):
        raise RuntimeError("the loss turned NaN")

    monkeypatch.setattr(recipe, "train_from", fail)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        train(tiny_run(tiny_model_dir, out))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failed_resume_keeps_the_checkpoints_it_resumes(tiny_model_dir, tmp_path, monkeypatch):
    from marslm.training import recipe

    out = tmp_path / "out"
    partial = partial_dir_of(str(out))
    partial.mkdir()
    (partial / "keep-me").write_text("an earlier run's")

    def fail(trainer, checkpoint):
        raise RuntimeError("killed")

    monkeypatch.setattr(recipe, "train_from", fail)
    with pytest.raises(RuntimeError):
        train(tiny_run(tiny_model_dir, out))
    assert (partial / "keep-me").is_file()


@pytest.mark.parametrize(
    "output, overwrite, fragment",
    [
        (".", True, "holds the working directory"),
        ("a-file", True, "is a file; give a directory"),
        ("a-file/out", False, "is a file, not a directory"),
    ],
)
def test_an_output_that_cannot_hold_the_checkpoint_is_refused_up_front(
    tmp_path, monkeypatch, output, overwrite, fragment
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("the user's")
    cfg = TrainConfig(stage="mars", model="m", data="toy", output=output, overwrite=overwrite)
    with pytest.raises(UserError, match=fragment):
        cfg.validate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
