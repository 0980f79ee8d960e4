"""`marslm bench` with a separate drafter (--draft-model): marslm's drafter on each checkpoint and
HF assisted generation, their forwards counted, and what a drafter contender is refused without.

Random tiny checkpoints of one tokenizer (conftest.py's drafter_dirs), so no training runs first: the target
stands in for both the MARS and the AR checkpoint, and a model of other random weights drafts
for it, its drafts mostly rejected, so verification does the work and the outputs are the target's.
"""

import json

import pytest

from marslm.bench.config import CONTENDER_GROUPS, DRAFTER_GROUPS, BenchConfig
from marslm.bench.contenders import default_contenders
from marslm.cli import main
from marslm.errors import UserError


def bench_args(drafter_dirs, *extra):
    return [
        "bench",
        "--model",
        str(drafter_dirs["target"]),
        "--ar-model",
        str(drafter_dirs["target"]),
        "--n",
        "2",
        "--repeats",
        "1",
        "--max-new-tokens",
        "16",
        "--dtype",
        "float64",
        "--quiet",
        *extra,
    ]


def test_drafter_contenders_verify_to_greedy_and_count_both_models_forwards(drafter_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--draft-model", str(drafter_dirs["drafter"]), "--num-draft-tokens", "3", "--batch-sizes", "1,2"]
    args += ["--contenders", "hf-mars,draft,draft-ar,assisted", "--taus", "1,0.9", "--json", str(out)]
    assert main(bench_args(drafter_dirs, *args)) == 0
    table = capsys.readouterr().out
    assert "drafter fwd" in table and "tok/fwd counts the target's forwards" in table
    report = json.loads(out.read_text())
    assert report["draft_model"] == str(drafter_dirs["drafter"])
    rows = {(r["contender"], r["batch_size"]): r for r in report["rows"]}
    drafted = ["draft K=3 -> MARS tau=1.0", "draft K=3 -> MARS tau=0.9", "draft K=3 -> AR"]
    assert [name for name, batch in rows if batch == 1] == [
        "HF generate (AR ckpt)",
        "HF generate (MARS ckpt)",
        *drafted,
        "HF assisted K=3 (AR ckpt)",
    ]
    for batch in (1, 2):
        for name in drafted:
            row = rows[(name, batch)]
            assert row["drafter_forwards"] > 0 and row["tokens_per_forward"] >= 1.0
            assert row["options"]["num_draft_tokens"] == 3
            assert ("note" in row) == (batch > 1)  # rows decode one after another
        # plain verification is lossless: the target's greedy output, on either checkpoint
        assert rows[("draft K=3 -> MARS tau=1.0", batch)]["same_as_greedy"] is True
        assert rows[("draft K=3 -> AR", batch)]["same_as_greedy"] is True
        assert "drafter_forwards" not in rows[("HF generate (AR ckpt)", batch)]
    assisted = rows[("HF assisted K=3 (AR ckpt)", 1)]
    assert assisted["same_as_greedy"] is True and assisted["drafter_forwards"] > 0
    assert assisted["options"]["num_assistant_tokens_schedule"] == "constant"
    assert "batch size 1 only" in rows[("HF assisted K=3 (AR ckpt)", 2)]["refused"]


def test_assisted_drafts_k_tokens_every_step(drafter_dirs, tmp_path):
    """HF reads K from the assistant's generation config: a constant schedule with no confidence
    cut-off drafts K tokens every step, so K = 5 runs the drafter more often than K = 2."""
    out = tmp_path / "bench.json"
    args = ["--draft-model", str(drafter_dirs["drafter"]), "--batch-sizes", "1", "--contenders", "assisted"]
    assert main(bench_args(drafter_dirs, *args, "--num-draft-tokens", "2", "--json", str(out))) == 0
    few = json.loads(out.read_text())["rows"][1]
    assert main(bench_args(drafter_dirs, *args, "--num-draft-tokens", "5", "--json", str(out))) == 0
    many = json.loads(out.read_text())["rows"][1]
    assert many["drafter_forwards"] > few["drafter_forwards"]


def test_drafter_groups_need_a_drafter_refused_when_the_config_is_made(drafter_dirs, capsys):
    with pytest.raises(UserError, match=r"contender group\(s\) draft, assisted need --draft-model"):
        BenchConfig(model="m", ar_model="a", contenders=["cursor", "draft", "assisted"])
    assert main(bench_args(drafter_dirs, "--contenders", "draft-ar")) == 2
    err = capsys.readouterr().err
    assert "contender group(s) draft-ar need --draft-model" in err and err.count("\n") == 1
    # by default every group runs, the drafter's only with a drafter
    assert BenchConfig(model="m", ar_model="a").contenders == [g for g in CONTENDER_GROUPS if g not in DRAFTER_GROUPS]
    with_drafter = BenchConfig(model="m", ar_model="a", drafting=_drafting("d"))
    assert with_drafter.contenders == list(CONTENDER_GROUPS)


def test_a_drafter_with_another_tokenizer_is_refused_before_decoding(drafter_dirs, capsys):
    args = ["--draft-model", str(drafter_dirs["other"]), "--contenders", "assisted", "--batch-sizes", "1"]
    assert main(bench_args(drafter_dirs, *args)) == 2
    err = capsys.readouterr().err
    assert "the draft model's tokenizer differs from the target's" in err and err.count("\n") == 1


def test_drafter_contenders_carry_their_settings():
    config = BenchConfig(
        model="m", ar_model="a", taus=[0.9], contenders=list(DRAFTER_GROUPS), max_new_tokens=7, drafting=_drafting("d")
    )
    contenders = {c.name: c for c in default_contenders(config)}
    assert list(contenders) == [
        "HF generate (AR ckpt)",
        "draft K=4 -> MARS tau=0.9",
        "draft K=4 -> AR",
        "HF assisted K=4 (AR ckpt)",
    ]
    draft = contenders["draft K=4 -> MARS tau=0.9"]
    assert (draft.kind, draft.checkpoint, draft.params.tau, draft.params.max_new_tokens) == ("draft", "mars", 0.9, 7)
    plain = contenders["draft K=4 -> AR"]
    assert (plain.kind, plain.checkpoint, plain.params.tau) == ("draft", "ar", 1.0)
    assisted = contenders["HF assisted K=4 (AR ckpt)"]
    assert (assisted.kind, assisted.checkpoint, assisted.options["num_assistant_tokens"]) == ("hf-assisted", "ar", 4)


def _drafting(path):
    from marslm.decode.draft_options import DraftOptions

    return DraftOptions(draft_model=path)
