"""``marslm bench``'s groups that tell the fallback's levers apart (cursor-paper, cursor-adaptive,
cursor-limit, cursor-auto: the default) and the fallback options of the other MARS contenders."""

import json

import pytest

from marslm.bench.config import BenchConfig
from marslm.bench.contenders import default_contenders
from marslm.cli import main
from marslm.decode import PAPER_RULE, costs
from marslm.errors import UserError


def names(config: BenchConfig) -> list[str]:
    return [c.name for c in default_contenders(config)]


def test_each_fallback_group_runs_each_tau_named_by_what_it_sets():
    groups = ["block", "cursor", "cursor-paper", "cursor-adaptive", "cursor-limit", "cursor-auto", "lossless"]
    config = BenchConfig(model="m", ar_model="a", taus=[0.9, 0.8], contenders=groups)
    contenders = {c.name: c for c in default_contenders(config)}
    assert list(contenders)[3:] == [  # cursor-auto is the default, so the cursor group's row
        "MARS cursor tau=0.9",
        "MARS cursor paper-rule tau=0.9",
        "MARS cursor adaptive-width tau=0.9",
        "MARS cursor mask-limit=auto tau=0.9",
        "MARS block16 tau=0.8",
        "MARS block32 tau=0.8",
        "MARS cursor tau=0.8",
        "MARS cursor paper-rule tau=0.8",
        "MARS cursor adaptive-width tau=0.8",
        "MARS cursor mask-limit=auto tau=0.8",
        "MARS lossless",
    ]
    expected = {
        "MARS cursor tau=0.8": (True, "auto"),
        "MARS cursor paper-rule tau=0.8": (False, None),
        "MARS cursor adaptive-width tau=0.8": (True, None),
        "MARS cursor mask-limit=auto tau=0.8": (False, "auto"),
    }
    for name, setting in expected.items():
        c = contenders[name]
        assert (c.decoder.adaptive_width, c.decoder.mask_batch_limit) == setting, name
        assert (c.params.tau, c.params.mode, c.decoder.cache) == (0.8, "threshold", "cursor")
    assert contenders["MARS cursor paper-rule tau=0.8"].options == {"tau": 0.8, "cache": "cursor", **PAPER_RULE}


def test_the_fallback_options_reach_every_contender_but_the_block_cache():
    groups = ["none", "block", "cursor", "cursor-adaptive", "cursor-auto", "lossless"]
    config = BenchConfig(model="m", ar_model="a", taus=[0.9], contenders=groups, mask_batch_limit=4)
    contenders = {c.name: c for c in default_contenders(config)}
    assert list(contenders)[1:] == [
        "MARS none adaptive-width mask-limit=4 tau=0.9",
        "MARS block16 tau=0.9",
        "MARS block32 tau=0.9",
        "MARS cursor adaptive-width mask-limit=4 tau=0.9",
        "MARS cursor adaptive-width tau=0.9",  # the groups that set their own ignore the flags
        "MARS cursor tau=0.9",
        "MARS lossless adaptive-width mask-limit=4",
    ]
    block = contenders["MARS block16 tau=0.9"]
    assert block.options == {"tau": 0.9, "cache": "block", "block_cache_size": 16}
    assert contenders["MARS lossless adaptive-width mask-limit=4"].decoder.mask_batch_limit == 4
    paper = BenchConfig(model="m", ar_model="a", taus=[0.9], contenders=["cursor"], **PAPER_RULE)
    assert [c.name for c in default_contenders(paper)][1:] == ["MARS cursor paper-rule tau=0.9"]
    with pytest.raises(UserError, match="mask_batch_limit must be an integer >= 1, auto"):
        BenchConfig(model="m", ar_model="a", mask_batch_limit="never")


def test_the_cost_curve_saves_the_table_an_auto_limit_decodes_by(trained_dirs, tmp_path):
    """``bench --cost-curve --save`` leaves the checkpoint's cost table; decoding under ``auto``
    then names it in its stats, and a bench of the auto contender runs over it."""
    import shutil

    from marslm.decode import generate
    from marslm.modeling import load_model

    root, out = trained_dirs["dir"], tmp_path / "bench.json"
    mars = tmp_path / "mars"
    shutil.copytree(root / "mars", mars)
    argv = ["bench", "--cost-curve", "--save", "--model", mars, "--contexts", 16, "--repeats", 1]
    assert main([str(a) for a in argv + ["--batch-sizes", "1,2", "--quiet"]]) == 0
    table = json.loads((mars / costs.COST_TABLE).read_text())
    assert set(table["costs"]) == {"1", "2"} and all(c > 0 for c in table["costs"].values())
    model, tokenizer, _ = load_model(str(mars))
    decoded = generate(model, tokenizer, [[5, 6, 7]], tau=0.8, max_new_tokens=4, mask_batch_limit="auto")
    assert decoded.stats.cost_table == str(mars / costs.COST_TABLE)
    argv = ["bench", "--model", mars, "--ar-model", root / "ar", "--contenders", "cursor-auto"]
    argv += ["--taus", "0.9", "--n", 3, "--repeats", 1, "--batch-sizes", "2", "--max-new-tokens", 6]
    assert main([str(a) for a in argv + ["--json", out, "--quiet"]]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["contender"] for r in rows} == {"HF generate (AR ckpt)", "MARS cursor tau=0.9"}


def test_save_needs_the_cost_curve_and_a_local_checkpoint():
    with pytest.raises(UserError, match="--save goes with --cost-curve"):
        BenchConfig(model="m", ar_model="a", save=True)
    with pytest.raises(UserError, match="beside a local checkpoint"):
        BenchConfig(model="org/hub-id", cost_curve=True, save=True)
