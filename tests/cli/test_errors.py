"""Every bad input the CLI met in a probe: one line on stderr and exit 2 (never a traceback), or a
warning that says what is assumed (never a silent success)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from marslm import cli


@pytest.fixture(scope="module")
def mars_dir(trained_dirs) -> Path:
    return trained_dirs["dir"] / "mars"


@pytest.fixture
def broken(mars_dir, tmp_path):
    """``broken(how)``: a copy of the trained MARS checkpoint, damaged as ``how`` says."""

    def make(how: str) -> Path:
        path = tmp_path / how
        shutil.copytree(mars_dir, path)
        weights = path / "model.safetensors"
        if how == "truncated-weights":
            data = weights.read_bytes()
            weights.write_bytes(data[: len(data) // 2])
        elif how == "empty-weights":
            weights.write_bytes(b"")
        elif how == "invalid-marslm-json":
            (path / "marslm.json").write_text('{"stage": "mars",')
        elif how == "list-marslm-json":
            (path / "marslm.json").write_text("[]")
        elif how == "no-marslm-json":
            (path / "marslm.json").unlink()
        elif how == "mask-id-outside-vocab":
            config = json.loads((path / "marslm.json").read_text())
            (path / "marslm.json").write_text(json.dumps({**config, "mask_token_id": 99999}))
        elif how == "no-tokenizer-json":
            (path / "tokenizer.json").unlink()
        else:
            raise ValueError(how)
        return path

    return make


def run(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc: int, err: str, *fragments: str) -> None:
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("marslm "), err
    for fragment in fragments:
        assert fragment in err, err


PROMPT = "Sort the list [3, 1, 2] in ascending order."


@pytest.mark.parametrize(
    "how, fragment",
    [
        ("truncated-weights", "cannot load model"),
        ("empty-weights", "cannot load model"),
        ("invalid-marslm-json", "marslm.json:1: malformed JSON"),
        ("list-marslm-json", "marslm.json must hold a JSON object, got list"),
        ("mask-id-outside-vocab", "mask_token_id 99999, outside the model's vocabulary"),
        ("no-tokenizer-json", "turns text into no tokens"),
    ],
)
def test_broken_checkpoints_are_one_line_errors(broken, capsys, how, fragment):
    path = broken(how)
    rc, out, err = run(capsys, "generate", "--model", path, "--prompt", PROMPT, "--max-new-tokens", 4)
    assert_one_line_error(rc, err, fragment)
    assert out == ""


def test_broken_weights_in_train_and_eval(broken, capsys, tmp_path):
    path = broken("truncated-weights")
    rc, _, err = run(
        capsys,
        "train",
        "ar",
        "--model",
        path,
        "--data",
        "toy",
        "--data-n",
        8,
        "-o",
        tmp_path / "out",
        "--max-steps",
        1,
        "--quiet",
    )
    assert_one_line_error(rc, err, "cannot load model")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    rc, _, err = run(capsys, "eval", "--model", path, "--n", 4, "--quiet")
    assert_one_line_error(rc, err, "cannot load model")


def test_a_checkpoint_without_marslm_json_warns_what_is_assumed(broken, capsys, caplog):
    path = broken("no-marslm-json")
    with caplog.at_level(logging.WARNING, logger="marslm"):
        rc, out, _ = run(capsys, "generate", "--model", path, "--prompt", PROMPT, "--max-new-tokens", 4)
    assert rc == 0 and out.strip()
    assert "has no marslm.json" in caplog.text and "assumes block size 4" in caplog.text


@pytest.mark.parametrize("command", ["generate", "show"])
def test_a_checkpoint_without_marslm_json_refused_by_a_flag_shows_only_the_error(broken, capsys, caplog, command):
    path = broken("no-marslm-json")
    with caplog.at_level(logging.WARNING, logger="marslm"):
        rc, _, err = run(capsys, command, "--model", path, "--prompt", PROMPT, "--block-size", 5)
    assert_one_line_error(rc, err, "block size must be in 1..4")
    assert caplog.records == []  # no "assumes block size 4" line before it


def test_an_ar_checkpoint_below_tau_1_warns(trained_dirs, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="marslm"):
        rc, _, _ = run(
            capsys,
            "generate",
            "--model",
            trained_dirs["dir"] / "ar",
            "--prompt",
            PROMPT,
            "--tau",
            0.5,
            "--max-new-tokens",
            4,
        )
    assert rc == 0 and "is an AR checkpoint" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="marslm"):
        rc, _, _ = run(
            capsys,
            "generate",
            "--model",
            trained_dirs["dir"] / "ar",
            "--prompt",
            PROMPT,
            "--tau",
            1,
            "--max-new-tokens",
            4,
        )
    assert rc == 0 and "AR checkpoint" not in caplog.text


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--block-size", "5"], "block size must be in 1..4"),  # what the server answers too
        (["--block-size", "100"], "block size must be in 1..4"),
        (["--mode", "lossless", "--block-size", "1"], "lossless mode needs at least one mask"),
        (["--block-cache-size", "0", "--cache", "block"], "block_cache_size must be >= 1"),
        (["--tau", "nan"], "tau"),
    ],
)
def test_generate_refuses_what_the_server_refuses(mars_dir, capsys, flags, fragment):
    rc, out, err = run(capsys, "generate", "--model", mars_dir, "--prompt", PROMPT, "--max-new-tokens", 4, *flags)
    assert_one_line_error(rc, err, fragment)


def test_lone_surrogates_are_refused(mars_dir, capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--model", mars_dir, "--prompt", "hi \udcff")
    assert_one_line_error(rc, err, "lone surrogate")
    data = tmp_path / "data.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}\n'
        '{"messages": [{"role": "user", "content": "hi \\ud800"}, '
        '{"role": "assistant", "content": "ok"}]}\n'
    )
    rc, _, err = run(
        capsys, "train", "ar", "--model", mars_dir, "--data", data, "-o", tmp_path / "out", "--max-steps", 1, "--quiet"
    )
    assert_one_line_error(rc, err, "data.jsonl:2", "lone surrogate")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--device", "foo"], "unknown device 'foo'"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
    ],
)
def test_eval_refuses_bad_settings(mars_dir, capsys, flags, fragment):
    rc, _, err = run(capsys, "eval", "--model", mars_dir, "--n", 4, "--quiet", *flags)
    assert_one_line_error(rc, err, fragment)


def test_eval_exits_non_zero_when_a_cell_failed_after_writing_the_rest(mars_dir, capsys, tmp_path, monkeypatch):
    from marslm.decode import generation

    real = generation.generate

    def failing_below_tau_1(model, tokenizer, prompts, params, *args, **kwargs):
        if params.tau < 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(model, tokenizer, prompts, params, *args, **kwargs)

    monkeypatch.setattr(generation, "generate", failing_below_tau_1)
    report = tmp_path / "sweep.json"
    rc, out, err = run(capsys, "eval", "--model", mars_dir, "--n", 4, "--tau", "1,0.9", "--json", report, "--quiet")
    assert rc == 1 and "1 of 2 cells failed" in err
    cells = json.loads(report.read_text())["results"]
    assert ["failed" in c for c in cells] == [False, True] and cells[0]["accuracy"] >= 0

    monkeypatch.setattr(generation, "generate", real)  # the rerun retries the failed cell
    rc, _, err = run(capsys, "eval", "--model", mars_dir, "--n", 4, "--tau", "1,0.9", "--json", report, "--quiet")
    assert rc == 0, err


DEEP = "[" * 100_000  # deeper than Python's recursion limit
LONG_INTEGER = '{"n": ' + "7" * 5000 + "}"  # longer than int() converts


@pytest.mark.parametrize("text, reason", [(DEEP, "nested too deeply"), (LONG_INTEGER, "an integer longer than")])
def test_hostile_json_is_a_one_line_error_naming_file_and_line(tiny_model_dir, capsys, tmp_path, text, reason):
    good = json.dumps({"prompt": "q", "completion": "a", "question": "q", "answer": "#### 1"})  # chat and GSM8K
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text(f"{good}\n{text}\n")
    report = tmp_path / "report.json"
    report.write_text(text)
    out = tmp_path / "out"
    commands = [
        (["train", "ar", "--model", tiny_model_dir, "--data", jsonl, "-o", out, "--max-steps", 1], "data.jsonl:2"),
        (["distill", "--model", tiny_model_dir, "--output", out / "d.jsonl", "--prompts", jsonl], "data.jsonl:2"),
        (["eval", "--model", tiny_model_dir, "--data", f"gsm8k:{jsonl}", "--n", 2, "--quiet"], "data.jsonl:2"),
        (["eval", "--model", tiny_model_dir, "--data", "reworded", "--n", 2, "--json", report], "report.json"),
        (["plot", report, "--out", out / "plot.png"], "report.json"),
    ]
    for args, where in commands:
        rc, _, err = run(capsys, *args)
        assert_one_line_error(rc, err, f"{where}: malformed JSON ({reason}")
    assert not out.exists()
