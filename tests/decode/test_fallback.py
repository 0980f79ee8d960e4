"""Offline decoding falls back to what costs least: adaptive width and ``mask_batch_limit="auto"``
in ``generate``, deciding from the cost table saved beside the checkpoint (costs.py), never from a
clock, and keeping nothing on the model between calls."""

import json

import pytest

from marslm import generate
from marslm.decode import PAPER_RULE, DecoderOptions, costs
from marslm.errors import UserError
from marslm.modeling import checkpoint_facts

MAX_NEW = 32
TOKEN_PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15, 16, 17, 18]]  # for the tiny random model


@pytest.fixture
def mars64(trained_checkpoints):
    model, tokenizer = trained_checkpoints["mars64"]
    return model, tokenizer


@pytest.fixture
def tiny(make_tiny_model, tiny_tokenizer):
    """A random model of its own (what a step feeds does not depend on training)."""
    return make_tiny_model(), tiny_tokenizer


def saved_costs(monkeypatch, model, tokenizer, folder, cost: float, block_size: int | None = None) -> str:
    """A cost table beside ``model`` (its name_or_path moved to ``folder``) where a masked step costs
    ``cost`` one-token steps at every batch size; returns the table's path."""
    block_size = block_size or checkpoint_facts(model, tokenizer).block_size
    folder.mkdir(parents=True, exist_ok=True)
    table = {"block_size": block_size, "costs": {str(b): cost for b in (1, 2, 4, 8)}, "measured_on": {}}
    path = costs.save_cost_table(folder, table)
    monkeypatch.setattr(model, "name_or_path", str(folder))
    return str(path)


def fed_inputs(model):
    """A list that collects every forward's ``input_ids``, and the hook's handle."""
    fed = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"]), with_kwargs=True)
    return fed, handle


@pytest.mark.parametrize("cost", [None, 0.01, 100.0])  # no table; masks always pay; never
@pytest.mark.parametrize("mode", ["threshold", "lossless", "hybrid"])
def test_greedy_answers_at_tau_1_and_lossless_are_plain_ar(mars64, prompts, monkeypatch, tmp_path, cost, mode):
    model, tokenizer = mars64
    path = None if cost is None else saved_costs(monkeypatch, model, tokenizer, tmp_path, cost)
    plain = generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=MAX_NEW)
    fallback = dict(adaptive_width=True, mask_batch_limit="auto", batch_size=2)  # rows refill: the batch changes
    out = generate(model, tokenizer, prompts, tau=1.0, mode=mode, max_new_tokens=MAX_NEW, **fallback)
    assert out.token_ids == plain.token_ids
    assert out.stats.cost_table == (None if mode == "threshold" else path)  # tau-1 threshold rows read no masks


def auto_limit_decode(tiny, monkeypatch, folder, step_cost: float):
    """TOKEN_PROMPTS decoded at tau 0.7 under the auto limit alone (no adaptive width), every masked
    step costing ``step_cost`` by the saved table: what each forward fed, the result, and the mask id."""
    model, tokenizer = tiny
    saved_costs(monkeypatch, model, tokenizer, folder, step_cost)
    fed, handle = fed_inputs(model)
    try:
        limit = dict(mask_batch_limit="auto", adaptive_width=False)
        out = generate(model, tokenizer, TOKEN_PROMPTS, tau=0.7, max_new_tokens=MAX_NEW, **limit)
    finally:
        handle.remove()
    return fed, out, checkpoint_facts(model, tokenizer).mask_token_id


def test_where_masks_never_pay_a_batch_decodes_as_ar(tiny, monkeypatch, tmp_path):
    """Above the limit no row reads masks: after the first step (the prompts) every forward of
    several rows feeds one pending token per row."""
    fed, out, mask_id = auto_limit_decode(tiny, monkeypatch, tmp_path, 100.0)
    several = [ids for ids in fed if len(ids) > 1]
    assert len(several) > 5 and all(ids.shape[1] == 1 for ids in several[1:])
    assert not any((ids == mask_id).any() for ids in several)
    assert out.stats.masked_row_steps == sum((ids == mask_id).any().item() for ids in fed)  # one row each


def test_where_masks_pay_a_batch_reads_them(tiny, monkeypatch, tmp_path):
    fed, out, mask_id = auto_limit_decode(tiny, monkeypatch, tmp_path, 0.01)
    assert all((ids == mask_id).any() for ids in fed if len(ids) == len(TOKEN_PROMPTS))
    assert out.stats.masked_row_steps >= len(TOKEN_PROMPTS) * (len(fed) > 1)


def test_the_default_decoder_falls_back_by_the_saved_table(tiny, monkeypatch, tmp_path):
    """With no settings, ``generate`` reads the checkpoint's cost table and, where masks never pay,
    reads fewer of them than the paper's rule does; without a table it sets no batch limit."""
    (model, tokenizer), prompts = tiny, TOKEN_PROMPTS
    no_table = generate(model, tokenizer, prompts, tau=0.7, max_new_tokens=MAX_NEW, adaptive_width=False)
    path = saved_costs(monkeypatch, model, tokenizer, tmp_path, 100.0)
    default = generate(model, tokenizer, prompts, tau=0.7, max_new_tokens=MAX_NEW)
    assert default.stats.cost_table == path and no_table.stats.cost_table is None
    paper = generate(model, tokenizer, prompts, tau=0.7, max_new_tokens=MAX_NEW, **PAPER_RULE)
    assert default.stats.masked_row_steps < paper.stats.masked_row_steps / 2
    assert no_table.token_ids == paper.token_ids


def test_decoding_times_nothing_and_keeps_nothing_on_the_model(tiny, monkeypatch, tmp_path):
    """No clock decides (every timer the decoder could read raises) and nothing is left on the
    model: a second call, alone or after others, decodes as the first."""
    import time

    (model, tokenizer), prompts = tiny, TOKEN_PROMPTS
    saved_costs(monkeypatch, model, tokenizer, tmp_path, 1.2)
    before = set(vars(model))

    def no_clock(*_):
        raise AssertionError("decoding read a clock")

    for name in ("perf_counter", "monotonic", "time"):
        monkeypatch.setattr(time, name, no_clock)
    auto = dict(tau=0.7, max_new_tokens=MAX_NEW, batch_size=2)
    first = generate(model, tokenizer, prompts, **auto)
    for settings in (dict(tau=0.8), dict(mode="lossless"), {}):
        again = generate(model, tokenizer, prompts, **{**auto, **settings})
    monkeypatch.undo()
    assert again.token_ids == first.token_ids
    assert set(vars(model)) == before


def test_a_table_for_another_block_size_is_not_read_and_a_broken_one_is_refused(tiny, monkeypatch, tmp_path):
    model, tokenizer = tiny
    block = checkpoint_facts(model, tokenizer).block_size
    saved_costs(monkeypatch, model, tokenizer, tmp_path, 100.0, block_size=block + 1)
    assert generate(model, tokenizer, TOKEN_PROMPTS[:1], tau=0.7, max_new_tokens=4).stats.cost_table is None
    (tmp_path / costs.COST_TABLE).write_text(json.dumps({"block_size": block, "costs": {"1": "cheap"}}))
    with pytest.raises(UserError, match="not a cost table") as refused:
        generate(model, tokenizer, TOKEN_PROMPTS[:1], tau=0.7, max_new_tokens=4)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("limit", ["sometimes", "", 0, 2.5, True])
def test_a_bad_batch_limit_is_refused_in_one_line(limit):
    with pytest.raises(UserError, match="mask_batch_limit must be an integer >= 1, auto or None") as refused:
        DecoderOptions(mask_batch_limit=limit)
    assert "\n" not in str(refused.value)
    assert DecoderOptions(mask_batch_limit="auto").mask_batch_limit == "auto"
