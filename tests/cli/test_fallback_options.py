"""``--[no-]adaptive-width`` and ``--mask-batch-limit N|auto|off`` on ``marslm generate``, ``eval``
and ``bench``: declared once (DecoderOptions' fields), refused in one line, handed to the decoder."""

from __future__ import annotations

import json

import pytest

from marslm.cli import build_parser, main
from marslm.decode import ADAPTIVE_WIDTH, MASK_BATCH_LIMIT, PAPER_RULE, generation
from tests.cli.test_bounds import no_model_loads  # noqa: F401 - a fixture
from tests.cli.test_errors import assert_one_line_error, run

COMMANDS = {
    "generate": ["generate", "--model", "m", "--prompt", "x"],
    "eval": ["eval", "--model", "m"],
    "bench": ["bench", "--model", "m", "--ar-model", "a"],
}


@pytest.fixture
def decoders(monkeypatch) -> list:
    """The DecoderOptions of every generate() call behind a command (bench holds its own name for it)."""
    from marslm.bench import speed as bench

    seen = []
    real = generation.generate

    def spy(model, tokenizer, prompts, params=None, decoder=None, **kwargs):
        seen.append(decoder)
        return real(model, tokenizer, prompts, params, decoder, **kwargs)

    monkeypatch.setattr(generation, "generate", spy)
    monkeypatch.setattr(bench, "generate", spy)
    return seen


@pytest.mark.parametrize("command", COMMANDS)
def test_every_decoding_command_parses_them(command):
    parser, argv = build_parser(), COMMANDS[command]
    plain = parser.parse_args(argv)
    assert plain.adaptive_width is ADAPTIVE_WIDTH and plain.mask_batch_limit == MASK_BATCH_LIMIT
    args = parser.parse_args(argv + ["--adaptive-width", "--mask-batch-limit", "auto"])
    assert args.adaptive_width is True and args.mask_batch_limit == "auto"
    args = parser.parse_args(argv + ["--no-adaptive-width", "--mask-batch-limit", "8"])
    assert args.adaptive_width is False and args.mask_batch_limit == 8
    args = parser.parse_args(argv + ["--no-adaptive-width", "--mask-batch-limit", "off"])
    assert {"adaptive_width": args.adaptive_width, "mask_batch_limit": args.mask_batch_limit} == PAPER_RULE


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "value, fragment", [("sometimes", "expected an integer, auto or off"), ("0", "must be an integer >= 1, auto")]
)
def test_a_bad_limit_is_refused_in_one_line(command, value, fragment, capsys, no_model_loads):  # noqa: F811
    try:
        rc = main(COMMANDS[command] + ["--mask-batch-limit", value])
    except SystemExit as exc:  # argparse's refusal
        rc = exc.code
    err = capsys.readouterr().err
    assert_one_line_error(rc, err, fragment)
    assert fragment in err


def test_generate_hands_them_to_the_decoder(trained_dirs, capsys, decoders):
    mars = trained_dirs["dir"] / "mars"
    argv = ["generate", "--model", mars, "--prompt", "Sort: [3, 1, 2]", "--max-new-tokens", 8, "--json"]
    rc, out, err = run(capsys, *argv, "--adaptive-width", "--mask-batch-limit", "auto")
    assert rc == 0, err
    assert json.loads(out)["tokens"] > 0
    assert [(d.adaptive_width, d.mask_batch_limit) for d in decoders] == [(True, "auto")]


def test_eval_hands_them_to_the_decoder_and_keys_its_cells_by_them(trained_dirs, capsys, decoders, tmp_path):
    mars, report = trained_dirs["dir"] / "mars", tmp_path / "eval.json"
    argv = ["eval", "--model", mars, "--n", 2, "--tau", "0.9", "--max-new-tokens", 8, "--json", report, "--quiet"]
    rc, _, err = run(capsys, *argv, "--adaptive-width", "--mask-batch-limit", "3")
    assert rc == 0, err
    assert [(d.adaptive_width, d.mask_batch_limit) for d in decoders] == [(True, 3)]
    rc, out, err = run(capsys, *argv, "--no-adaptive-width", "--mask-batch-limit", "off")  # decoded, not resumed
    assert rc == 0, err
    cells = json.loads(report.read_text())["results"]
    assert [(c["adaptive_width"], c["mask_batch_limit"]) for c in cells] == [(True, 3), (False, None)]
    assert "mask limit" in out and len(decoders) == 2


def test_bench_hands_them_to_every_contender_but_the_block_cache(trained_dirs, capsys, decoders, tmp_path):
    root, report = trained_dirs["dir"], tmp_path / "bench.json"
    argv = ["bench", "--model", root / "mars", "--ar-model", root / "ar", "--contenders", "cursor,block"]
    argv += ["--taus", "0.9", "--n", 2, "--repeats", 1, "--batch-sizes", 2, "--max-new-tokens", 6]
    rc, _, err = run(capsys, *argv, "--adaptive-width", "--mask-batch-limit", 2, "--json", report, "--quiet")
    assert rc == 0, err
    names = [r["contender"] for r in json.loads(report.read_text())["rows"]]
    assert names == [
        "HF generate (AR ckpt)",
        "MARS block16 tau=0.9",
        "MARS block32 tau=0.9",
        "MARS cursor adaptive-width mask-limit=2 tau=0.9",
    ]
    cursor = {(d.adaptive_width, d.mask_batch_limit) for d in decoders if d.cache == "cursor"}
    block = {(d.adaptive_width, d.mask_batch_limit) for d in decoders if d.cache == "block"}
    assert cursor == {(True, 2)} and block == {(ADAPTIVE_WIDTH, MASK_BATCH_LIMIT)}  # which the block cache ignores
