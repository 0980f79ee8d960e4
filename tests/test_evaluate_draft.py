"""`marslm eval --draft-model`: a separate drafter under every cell of a sweep, its cells keyed
apart from undrafted ones, and the refusals (generate's lines) before any decoding.

Random tiny checkpoints of one tokenizer (conftest.py's drafter_dirs), so
no training runs first: drafts from a model of other weights are mostly rejected, so a cell at
tau 1 must still give the plain greedy output.
"""

from __future__ import annotations

import json

import pytest

import marslm.decode.generation as generation
from marslm.decode.draft_options import DraftOptions
from marslm.errors import UserError
from marslm.eval.evaluate import EvalConfig, sweep
from tests.test_evaluate import SMALL, run_cli


@pytest.fixture
def outputs(monkeypatch):
    """Each decoding call of the sweep: whether a drafter ran, and the token ids it gave."""
    calls = []
    real = generation.generate

    def recording(model, tokenizer, prompts, params, *args, **kwargs):
        out = real(model, tokenizer, prompts, params, *args, **kwargs)
        calls.append({"drafted": "draft_model" in kwargs, "tau": params.tau, "token_ids": out.token_ids})
        return out

    monkeypatch.setattr(generation, "generate", recording)
    return calls


def test_a_drafted_sweep_at_tau_1_is_the_undrafted_one_token_for_token(drafter_dirs, tmp_path, outputs):
    model, path = str(drafter_dirs["target"]), tmp_path / "sweep.json"
    grid = dict(taus=[1.0], block_sizes=[4], json_path=path, **SMALL)
    sweep(EvalConfig([model], "toy", **grid))
    drafting = DraftOptions(draft_model=str(drafter_dirs["drafter"]), num_draft_tokens=3)
    drafted = sweep(EvalConfig([model], "toy", drafting=drafting, **grid))  # the same file: a new cell, none reused

    assert [c["drafted"] for c in outputs] == [False, True]
    assert outputs[1]["token_ids"] == outputs[0]["token_ids"]
    plain_cell, drafted_cell = drafted["results"]
    assert "draft_model" not in plain_cell and "drafter_forwards" not in plain_cell
    assert (drafted_cell["draft_model"], drafted_cell["num_draft_tokens"]) == (str(drafter_dirs["drafter"]), 3)
    assert drafted_cell["drafter_forwards"] > 0 and drafted_cell["accuracy"] == plain_cell["accuracy"]

    outputs.clear()  # the drafted sweep again: its cell is in the file
    sweep(EvalConfig([model], "toy", drafting=drafting, **grid))
    assert outputs == []


def test_drafted_one_token_cells_are_decoded_once_for_every_block_size(drafter_dirs, outputs):
    drafting = DraftOptions(draft_model=str(drafter_dirs["drafter"]), num_draft_tokens=2)
    grid = dict(taus=[1.0, 0.6], block_sizes=[2, 4], drafting=drafting, **SMALL)
    payload = sweep(EvalConfig([str(drafter_dirs["target"])], "toy", **grid))
    one_token = [c for c in payload["results"] if c["tau"] == 1.0]
    assert len(one_token) == 2 and "shared_with" in one_token[1]
    assert [(c["drafted"], c["tau"]) for c in outputs] == [(True, 1.0), (True, 0.6), (True, 0.6)]


def test_eval_cli_drafter_column_and_refusals(drafter_dirs, tmp_path):
    model, drafter = drafter_dirs["target"], drafter_dirs["drafter"]
    rc, out, _ = run_cli(
        "eval", "--model", model, "--n", 2, "--tau", "1", "--max-new-tokens", 8, "--quiet",
        "--draft-model", drafter, "--num-draft-tokens", 2, "--json", tmp_path / "r.json",
    )  # fmt: skip
    assert rc == 0 and "| model | drafter | K | tau |" in out
    cell = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert (cell["draft_model"], cell["num_draft_tokens"]) == (str(drafter), 2)

    for args, message in [
        (["--draft-model", drafter_dirs["other"]], "the draft model's tokenizer differs from the target's"),
        (["--draft-model", "/no/such/drafter"], "model not found: /no/such/drafter"),
        (["--draft-model", drafter, "--num-draft-tokens", 0], "--num-draft-tokens must be in 1..16, got 0"),
        (["--draft-model", drafter, "--mode", "lossless"], "a draft model decodes in threshold mode"),
    ]:
        rc, _, err = run_cli("eval", "--model", model, "--n", 2, "--max-new-tokens", 4, "--quiet", *args)
        assert rc == 2 and message in err and err.count("\n") == 1, (args, err)


def test_the_drafter_options_are_one_definition_for_generate_eval_and_bench(drafter_dirs):
    """The same flags and help on the three commands, and the same check of K."""
    from marslm.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    helps = set()
    for command in ("generate", "eval", "bench"):
        actions = {a.dest: a for a in subcommands[command]._actions}
        helps.add((actions["draft_model"].help, actions["num_draft_tokens"].help, actions["num_draft_tokens"].default))
    assert len(helps) == 1
    with pytest.raises(UserError, match="--num-draft-tokens must be in 1..16, got 17"):
        DraftOptions(draft_model="d", num_draft_tokens=17)
    with pytest.raises(UserError, match="^--num-draft-tokens needs --draft-model$"):
        DraftOptions(num_draft_tokens=0)  # it would do nothing without a drafter
    rc, out, _ = run_cli(
        "generate", "--model", drafter_dirs["target"], "--prompt", "What is 2 + 3?", "--tau", "1",
        "--max-new-tokens", 8, "--draft-model", drafter_dirs["drafter"], "--num-draft-tokens", 2, "--json",
    )  # fmt: skip
    assert rc == 0 and json.loads(out)["drafter_forwards"] > 0
