"""``marslm bench``'s cursor-auto group (adaptive width and the auto mask batch limit, the
candidate default) and the fallback options of the other MARS contenders."""

import json

import pytest

from marslm.cli import main
from marslm.decode import costs
from marslm.errors import UserError
from marslm.experiments.bench import default_contenders
from marslm.experiments.bench_config import BenchConfig


def names(config: BenchConfig) -> list[str]:
    return [c.name for c in default_contenders(config)]


def test_cursor_auto_runs_each_tau_with_adaptive_width_and_the_auto_limit():
    groups = ["block", "cursor", "cursor-adaptive", "cursor-limit", "cursor-auto", "lossless"]
    config = BenchConfig(model="m", ar_model="a", taus=[0.9, 0.8], contenders=groups)
    assert names(config)[3:] == [
        "MARS cursor tau=0.9",
        "MARS cursor adaptive-width tau=0.9",
        "MARS cursor mask-limit=auto tau=0.9",
        "MARS cursor adaptive-width mask-limit=auto tau=0.9",
        "MARS block16 tau=0.8",
        "MARS block32 tau=0.8",
        "MARS cursor tau=0.8",
        "MARS cursor adaptive-width tau=0.8",
        "MARS cursor mask-limit=auto tau=0.8",
        "MARS cursor adaptive-width mask-limit=auto tau=0.8",
        "MARS lossless",
    ]
    limit = {c.name: c for c in default_contenders(config)}["MARS cursor mask-limit=auto tau=0.8"]
    assert (limit.decoder.adaptive_width, limit.decoder.mask_batch_limit) == (False, "auto")
    auto = {c.name: c for c in default_contenders(config)}["MARS cursor adaptive-width mask-limit=auto tau=0.8"]
    assert auto.options == {"tau": 0.8, "cache": "cursor", "adaptive_width": True, "mask_batch_limit": "auto"}
    assert (auto.params.tau, auto.params.mode, auto.decoder.cache) == (0.8, "threshold", "cursor")
    assert (auto.decoder.adaptive_width, auto.decoder.mask_batch_limit) == (True, "auto")


def test_the_fallback_options_reach_every_contender_but_the_block_cache():
    groups = ["none", "block", "cursor", "cursor-adaptive", "cursor-auto", "lossless"]
    fallback = dict(adaptive_width=True, mask_batch_limit=4)
    config = BenchConfig(model="m", ar_model="a", taus=[0.9], contenders=groups, **fallback)
    contenders = {c.name: c for c in default_contenders(config)}
    assert list(contenders)[1:] == [  # cursor and cursor-adaptive now decode alike: one row
        "MARS none adaptive-width mask-limit=4 tau=0.9",
        "MARS block16 tau=0.9",
        "MARS block32 tau=0.9",
        "MARS cursor adaptive-width mask-limit=4 tau=0.9",
        "MARS cursor adaptive-width mask-limit=auto tau=0.9",
        "MARS lossless adaptive-width mask-limit=4",
    ]
    block = contenders["MARS block16 tau=0.9"]
    assert (block.decoder.adaptive_width, block.decoder.mask_batch_limit) == (False, None)
    assert contenders["MARS lossless adaptive-width mask-limit=4"].decoder.mask_batch_limit == 4
    with pytest.raises(UserError, match="mask_batch_limit must be an integer >= 1, auto"):
        BenchConfig(model="m", ar_model="a", mask_batch_limit="never")


def test_an_auto_limit_is_timed_in_the_warm_up_not_in_the_repeats(trained_dirs, tmp_path, monkeypatch):
    """Once per model and batch size, whatever the taus, repeats and chunks: the last chunk of 3
    prompts at batch 2 is shorter than the warm-up's, and still reads the warm-up's timing."""
    timed = []
    real = costs.masked_step_costs

    def counting(model, n_masks, batch_sizes):
        timed.append(tuple(batch_sizes))
        return real(model, n_masks, batch_sizes)

    monkeypatch.setattr(costs, "masked_step_costs", counting)
    root, out = trained_dirs["dir"], tmp_path / "bench.json"
    argv = ["bench", "--model", root / "mars", "--ar-model", root / "ar", "--contenders", "cursor-auto"]
    argv += ["--taus", "0.9,0.8", "--n", 3, "--repeats", 2, "--batch-sizes", "2,1", "--max-new-tokens", 6]
    assert main([str(a) for a in argv + ["--json", out, "--quiet"]]) == 0
    assert timed == [(1, 2), (1,)]
    rows = json.loads(out.read_text())["rows"]
    assert {r["contender"] for r in rows} == {
        "HF generate (AR ckpt)",
        "MARS cursor adaptive-width mask-limit=auto tau=0.9",
        "MARS cursor adaptive-width mask-limit=auto tau=0.8",
    }
    assert all(r["tokens_per_forward"] >= 1.0 for r in rows)
