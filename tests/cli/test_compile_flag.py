"""``--compile`` / ``--no-compile`` (unset: auto) on ``marslm generate``, ``eval``, ``bench`` and
``serve``: one help (DecoderOptions' field), handed to the decoder; bench runs each cursor contender
both ways and reports compile time apart from the timed rounds."""

from __future__ import annotations

import json

import pytest

from marslm.cli import build_parser
from marslm.decode import forward
from tests.cli.test_errors import assert_one_line_error, run
from tests.cli.test_fallback_options import COMMANDS, decoders  # noqa: F401 - a fixture

ALL = {**COMMANDS, "serve": ["serve", "--model", "m"]}


@pytest.mark.parametrize("command", ALL)
def test_every_decoding_command_parses_it(command):
    parser = build_parser()
    assert parser.parse_args(ALL[command]).compile == "auto"
    assert parser.parse_args(ALL[command] + ["--compile"]).compile is True
    assert parser.parse_args(ALL[command] + ["--no-compile"]).compile is False


def test_generate_and_eval_hand_it_to_the_decoder(trained_dirs, capsys, decoders, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(forward, "BACKEND", "eager")
    mars = trained_dirs["dir"] / "mars"
    argv = ["generate", "--model", mars, "--prompt", "Sort: [3, 1, 2]", "--max-new-tokens", 8, "--json"]
    rc, out, err = run(capsys, *argv, "--compile")
    assert rc == 0, err
    assert json.loads(out)["tokens"] > 0
    argv = ["eval", "--model", mars, "--n", 2, "--tau", "0.9", "--max-new-tokens", 8, "--quiet"]
    rc, _, err = run(capsys, *argv, "--compile", "--json", tmp_path / "eval.json")
    assert rc == 0, err
    assert [d.compile for d in decoders] == [True, True]


@pytest.mark.parametrize("cache", ["block", "none"])
def test_eval_refuses_it_with_another_cache_before_loading(cache, capsys, tmp_path):
    rc, out, err = run(capsys, "eval", "--model", tmp_path / "absent", "--cache", cache, "--compile")
    assert out == ""
    assert_one_line_error(rc, err, f"compile runs the cursor cache's step; cache={cache!r} decodes eagerly")


def test_bench_runs_each_cursor_contender_eager_and_compiled(trained_dirs, capsys, decoders, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(forward, "BACKEND", "eager")
    root, report = trained_dirs["dir"], tmp_path / "bench.json"
    argv = ["bench", "--model", root / "mars", "--ar-model", root / "ar", "--contenders", "cursor,lossless"]
    argv += ["--taus", "0.9", "--n", 2, "--repeats", 1, "--batch-sizes", 2, "--max-new-tokens", 6]
    rc, _, err = run(capsys, *argv, "--compile", "--json", report, "--quiet")
    assert rc == 0, err
    rows = {r["contender"]: r for r in json.loads(report.read_text())["rows"]}
    assert set(rows) == {
        "HF generate (AR ckpt)",
        "MARS cursor tau=0.9",
        "MARS lossless",
        "MARS cursor tau=0.9 compiled",
        "MARS lossless compiled",
        "HF generate static+compile (AR ckpt)",
    }
    for name in ("MARS cursor tau=0.9", "MARS lossless"):
        assert rows[name + " compiled"]["tokens_per_forward"] == rows[name]["tokens_per_forward"]
        assert rows[name + " compiled"]["speedup_vs_hf_compiled"] > 0
    # HF generate compiled decodes as HF generate does
    assert rows["HF generate static+compile (AR ckpt)"]["same_as_greedy"] is True
    assert {d.compile for d in decoders} == {False, True}
