"""Offline decoding falls back to what costs least: adaptive width and ``mask_batch_limit="auto"``
in ``generate``, with the step costs timed once per model (costs.py), as the server times them."""

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
    yield model, tokenizer
    for kept in (costs.STEP_COSTS_ATTR, costs.LIMITS_ATTR):  # a test's (fake) step costs reach no other test
        vars(model).pop(kept, None)


@pytest.fixture
def tiny(make_tiny_model, tiny_tokenizer):
    """A random model of its own (what a step feeds does not depend on training)."""
    return make_tiny_model(), tiny_tokenizer


def fake_costs(monkeypatch, cost: float) -> list:
    """Every batch size's masked step costs ``cost`` one-token steps; returns the list of what was timed."""
    timed = []

    def masked_step_costs(model, n_masks, batch_sizes):
        timed.append((n_masks, tuple(batch_sizes)))
        return {b: cost for b in batch_sizes}

    monkeypatch.setattr(costs, "masked_step_costs", masked_step_costs)
    return timed


def fed_inputs(model):
    """A list that collects every forward's ``input_ids``, and the hook's handle."""
    fed = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"]), with_kwargs=True)
    return fed, handle


@pytest.mark.parametrize("cost", [None, 0.01, 100.0])  # measured on this machine; masks always pay; never
@pytest.mark.parametrize("mode", ["threshold", "lossless", "hybrid"])
def test_greedy_answers_at_tau_1_and_lossless_are_plain_ar(mars64, prompts, monkeypatch, cost, mode):
    model, tokenizer = mars64
    if cost is not None:
        fake_costs(monkeypatch, cost)
    plain = generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=MAX_NEW)
    fallback = dict(adaptive_width=True, mask_batch_limit="auto", batch_size=2)  # rows refill: the batch changes
    out = generate(model, tokenizer, prompts, tau=1.0, mode=mode, max_new_tokens=MAX_NEW, **fallback)
    assert out.token_ids == plain.token_ids
    if mode != "threshold":  # tau-1 threshold rows read no masks: nothing to time
        assert vars(model)[costs.STEP_COSTS_ATTR]


def auto_limit_decode(tiny, monkeypatch, step_cost: float):
    """TOKEN_PROMPTS decoded at tau 0.7 under the auto limit alone (no adaptive width), every masked
    step costing ``step_cost``: what each forward fed, the result, and the mask id."""
    model, tokenizer = tiny
    fake_costs(monkeypatch, step_cost)
    fed, handle = fed_inputs(model)
    try:
        limit = dict(mask_batch_limit="auto", adaptive_width=False)
        out = generate(model, tokenizer, TOKEN_PROMPTS, tau=0.7, max_new_tokens=MAX_NEW, **limit)
    finally:
        handle.remove()
    return fed, out, checkpoint_facts(model, tokenizer).mask_token_id


def test_where_masks_never_pay_a_batch_decodes_as_ar(tiny, monkeypatch):
    """Above the limit no row reads masks: after the first step (the prompts) every forward of
    several rows feeds one pending token per row."""
    fed, out, mask_id = auto_limit_decode(tiny, monkeypatch, 100.0)
    several = [ids for ids in fed if len(ids) > 1]
    assert len(several) > 5 and all(ids.shape[1] == 1 for ids in several[1:])
    assert not any((ids == mask_id).any() for ids in several)
    assert out.stats.masked_row_steps == sum((ids == mask_id).any().item() for ids in fed)  # one row each


def test_where_masks_pay_a_batch_reads_them(tiny, monkeypatch):
    fed, out, mask_id = auto_limit_decode(tiny, monkeypatch, 0.01)
    assert all((ids == mask_id).any() for ids in fed if len(ids) == len(TOKEN_PROMPTS))
    assert out.stats.masked_row_steps >= len(TOKEN_PROMPTS) * (len(fed) > 1)


def test_the_default_decoder_falls_back(tiny, monkeypatch):
    """With no settings, ``generate`` times the step costs and, where masks never pay, reads fewer
    of them than the paper's rule does."""
    (model, tokenizer), prompts = tiny, TOKEN_PROMPTS
    timed = fake_costs(monkeypatch, 100.0)
    default = generate(model, tokenizer, prompts, tau=0.7, max_new_tokens=MAX_NEW)
    assert timed
    paper = generate(model, tokenizer, prompts, tau=0.7, max_new_tokens=MAX_NEW, **PAPER_RULE)
    assert default.stats.masked_row_steps < paper.stats.masked_row_steps / 2


def test_the_step_costs_are_timed_once_per_model(tiny, monkeypatch):
    (model, tokenizer), prompts = tiny, TOKEN_PROMPTS
    timed = fake_costs(monkeypatch, 1.2)
    block = checkpoint_facts(model, tokenizer).block_size
    auto = dict(tau=0.7, max_new_tokens=8, mask_batch_limit="auto")
    for _ in range(2):
        generate(model, tokenizer, prompts[:3], batch_size=2, **auto)
    assert timed == [(block, (1, 2))]
    generate(model, tokenizer, prompts[:3], **{**auto, "tau": 1.0})  # reads no masks: nothing to time
    generate(model, tokenizer, prompts[:3], batch_size=2, **{**auto, "block_size": 2})
    generate(model, tokenizer, prompts[:3], **auto)  # all three together
    assert timed == [(block, (1, 2)), (2, (1, 2)), (block, (1, 2, 3))]


def test_calls_of_one_workload_share_a_limit_and_other_workloads_have_their_own(tiny, monkeypatch):
    """What masks buy depends on the mode and tau: a call goes on with the limit of earlier calls
    with its settings, and another mode or tau starts afresh, over the same timed step costs."""
    (model, tokenizer), prompts = tiny, TOKEN_PROMPTS
    timed = fake_costs(monkeypatch, 1.2)
    auto = dict(max_new_tokens=8, mask_batch_limit="auto")
    for settings in (dict(tau=0.7), dict(tau=0.7), dict(tau=0.8), dict(tau=0.7, mode="lossless")):
        generate(model, tokenizer, prompts[:1], **auto, **settings)
    limits = vars(model)[costs.LIMITS_ATTR]
    assert len(timed) == 1 and len(limits) == 3
    assert sorted(key[2:4] for key in limits) == [("lossless", 0.7), ("threshold", 0.7), ("threshold", 0.8)]


@pytest.mark.parametrize("limit", ["sometimes", "", 0, 2.5, True])
def test_a_bad_batch_limit_is_refused_in_one_line(limit):
    with pytest.raises(UserError, match="mask_batch_limit must be an integer >= 1, auto or None") as refused:
        DecoderOptions(mask_batch_limit=limit)
    assert "\n" not in str(refused.value)
    assert DecoderOptions(mask_batch_limit="auto").mask_batch_limit == "auto"
