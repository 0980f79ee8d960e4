"""A drafter is checked against its target (vocabulary and tokenizer), and a drafting flag that would do
nothing in the chosen mode is refused in one line, before any model loads."""

from __future__ import annotations

import pytest

from marslm import generate
from marslm.errors import UserError
from marslm.modeling import load_model
from tests.cli.test_errors import assert_one_line_error, run
from tests.helpers import build_tiny_model


@pytest.fixture
def no_model_loads(monkeypatch):
    from marslm import modeling

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(modeling, "load_model", refuse)


def test_a_drafter_with_fewer_rows_than_the_target_is_refused(tiny_model_dir, tiny_tokenizer):
    """The same tokenizer, but the drafter scores only its tokens, not the target's 320 ids."""
    model, tokenizer, _ = load_model(str(tiny_model_dir))
    small = build_tiny_model(tiny_tokenizer, vocab_size=len(tiny_tokenizer))
    assert small.get_output_embeddings().weight.shape[0] < model.get_output_embeddings().weight.shape[0]
    with pytest.raises(UserError, match="^the draft model's vocabulary"):
        generate(model, tokenizer, ["hi"], max_new_tokens=2, draft_model=small, draft_tokenizer=tiny_tokenizer)
    same = build_tiny_model(tiny_tokenizer, seed=3)
    generate(model, tokenizer, ["hi"], max_new_tokens=2, draft_model=same, draft_tokenizer=tiny_tokenizer)


def test_a_drafter_with_another_tokenizer_is_refused(drafter_dirs, capsys):
    rc, _, err = run(
        capsys, "generate", "--model", drafter_dirs["target"], "--prompt", "hi", "--tau", 1,
        "--max-new-tokens", 2, "--draft-model", drafter_dirs["other"],
    )  # fmt: skip
    assert_one_line_error(rc, err, "the draft model's tokenizer differs from the target's")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--num-draft-tokens", 2], "--num-draft-tokens needs --draft-model"),
        (["--draft-model", "{drafter}", "--cache", "none"], "a draft model decodes in threshold mode with the cursor"),
        (["--draft-groups"], "draft_groups does nothing in threshold mode"),
        (["--draft-groups", "--mode", "threshold", "--tau", 0.9], "draft_groups does nothing in threshold mode"),
    ],
)
def test_a_flag_that_would_do_nothing_is_refused_before_loading(drafter_dirs, capsys, no_model_loads, flags, fragment):
    flags = [str(drafter_dirs["drafter"]) if f == "{drafter}" else f for f in flags]
    rc, out, err = run(capsys, "generate", "--model", drafter_dirs["target"], "--prompt", "hi", *flags)
    assert_one_line_error(rc, err, fragment)
    assert out == ""


@pytest.mark.parametrize("command", ["eval", "bench", "serve"])
def test_every_command_refuses_draft_tokens_without_a_drafter(drafter_dirs, capsys, tmp_path, no_model_loads, command):
    extra = ["--json", tmp_path / "r.json"] if command != "serve" else []
    rc, _, err = run(capsys, command, "--model", drafter_dirs["target"], "--num-draft-tokens", 3, *extra)
    assert_one_line_error(rc, err, "--num-draft-tokens needs --draft-model")


def test_draft_groups_run_in_lossless_mode(drafter_dirs, capsys):
    """The guard of the refusal above: where they do something, draft groups are taken."""
    rc, out, err = run(
        capsys, "generate", "--model", drafter_dirs["target"], "--prompt", "hi", "--mode", "lossless",
        "--draft-groups", "--max-new-tokens", 2,
    )  # fmt: skip
    assert rc == 0, err
