"""Decoding correctness on a trained tiny checkpoint.

The checkpoint is trained (AR SFT, then MARS) on the toy suite for a few seconds, so its
confidences spread from near 0 to near 1 and every acceptance path is exercised. Comparisons
run in float64: batch shape then cannot flip a near-tie, so any mismatch is a real bug.
"""

import pytest

from marslm import generate
from marslm.chat import encode_prompt, stop_token_ids
from marslm.data import toy
from marslm.decode import PAPER_RULE, DecodeBatch, DecodingParams
from marslm.errors import UserError
from marslm.modeling import checkpoint_facts
from tests.helpers import hf_greedy
from tests.trained import TRAIN_N


@pytest.fixture(scope="module")
def prompts(trained_checkpoints):
    _, tokenizer = trained_checkpoints["mars64"]
    examples = toy.make_split("train", TRAIN_N, seed=0)[::8]  # memorised prompts: confident masks
    return [encode_prompt(tokenizer, ex.messages) for ex in examples]


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("cache", ["none", "cursor", "block"])
def test_one_token_mode_equals_hf_greedy(trained_checkpoints, prompts, batch, cache):
    model, tokenizer = trained_checkpoints["mars64"]
    expected = hf_greedy(model, tokenizer, prompts[:batch], 48)
    out = generate(model, tokenizer, prompts[:batch], tau=1.0, cache=cache, max_new_tokens=48)
    assert out.token_ids == expected
    assert out.tokens_per_forward == 1.0


# The auto batch limit is left out: it follows the batch's size and this machine's clock, so under it
# a prompt's text at tau < 1 depends on its batch. Adaptive width is per row and reads no clock.
@pytest.mark.parametrize("rule", [PAPER_RULE, {"mask_batch_limit": None}], ids=["paper", "adaptive-width"])
def test_ragged_batch_equals_each_prompt_alone(trained_checkpoints, prompts, rule):
    model, tokenizer = trained_checkpoints["mars64"]
    together = generate(model, tokenizer, prompts, tau=0.7, max_new_tokens=48, **rule)
    alone = [generate(model, tokenizer, [p], tau=0.7, max_new_tokens=48, **rule) for p in prompts]
    assert together.token_ids == [a.token_ids[0] for a in alone]
    assert together.forwards == [a.forwards[0] for a in alone]
    assert together.tokens_per_forward > 1.1


TAUS = {"prob": [1.0, 0.95, 0.8], "margin": [1.0, 0.95, 0.8], "entropy": [0.0, 0.2, 0.6]}


@pytest.mark.parametrize("metric", ["prob", "margin", "entropy"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_cursor_cache_equals_recompute(trained_checkpoints, prompts, metric, batch):
    """With the last mask read (the default), which the reference sampler of test_oracle.py does not do."""
    model, tokenizer = trained_checkpoints["mars64"]
    for tau in TAUS[metric]:
        # no auto limit: it times this machine, and the two calls share what it measured and kept
        kwargs = dict(tau=tau, metric=metric, max_new_tokens=40, use_last_mask=True, mask_batch_limit=None)
        oracle = generate(model, tokenizer, prompts[:batch], cache="none", **kwargs)
        out = generate(model, tokenizer, prompts[:batch], cache="cursor", **kwargs)
        assert out.token_ids == oracle.token_ids, tau
        assert out.accepted_per_step == oracle.accepted_per_step, tau


def test_multi_token_acceptance_happens(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    out = generate(model, tokenizer, prompts, tau=0.6, max_new_tokens=48, use_last_mask=True, **PAPER_RULE)
    assert max(max(steps) for steps in out.accepted_per_step) == 5  # B + 1 with the last mask
    without = generate(model, tokenizer, prompts, tau=0.6, max_new_tokens=48, use_last_mask=False, **PAPER_RULE)
    assert max(max(steps) for steps in without.accepted_per_step) <= 4


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("cache", ["none", "cursor"])
@pytest.mark.parametrize("draft_groups", [False, True])
def test_lossless_equals_hf_greedy(trained_checkpoints, prompts, batch, cache, draft_groups):
    model, tokenizer = trained_checkpoints["mars64"]
    expected = hf_greedy(model, tokenizer, prompts[:batch], 48)
    out = generate(
        model,
        tokenizer,
        prompts[:batch],
        mode="lossless",
        cache=cache,
        draft_groups=draft_groups,
        use_last_mask=True,
        max_new_tokens=48,
        mask_batch_limit=None,  # so that the reach does not depend on this machine's timings
    )
    assert out.token_ids == expected
    assert out.tokens_per_forward > 1.0


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_hook(self._count)

    def _count(self, *_):
        self.calls += 1


@pytest.mark.parametrize("cache", ["none", "cursor", "block"])
def test_stats_are_exact(trained_checkpoints, prompts, cache):
    model, tokenizer = trained_checkpoints["mars64"]
    counter = ForwardCounter(model)
    try:
        # no auto limit: the forwards that time its step costs would count too
        settings = dict(tau=0.8, cache=cache, block_cache_size=8, max_new_tokens=40, mask_batch_limit=None)
        out = generate(model, tokenizer, prompts, **settings)
    finally:
        counter.handle.remove()
    assert out.batch_forwards == counter.calls
    most = 8 if cache == "block" else 5  # a cache block; else B + 1 with the last mask
    for ids, steps in zip(out.token_ids, out.accepted_per_step):
        assert all(1 <= s <= most for s in steps)
        assert sum(steps) in (len(ids), len(ids) + 1)  # + the stop token when one was produced
    if cache == "block":
        # the prefill, and a commit after every block but the last, accept nothing
        blocks = -(-max(sum(steps) for steps in out.accepted_per_step) // 8)
        assert out.batch_forwards >= max(out.forwards) + blocks
    else:  # rows never sit out a step, so the batch runs exactly as long as its longest row
        assert out.batch_forwards == max(out.forwards)


def test_max_new_tokens_and_eos(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    short = generate(model, tokenizer, prompts, tau=0.5, max_new_tokens=3)
    assert all(len(ids) <= 3 for ids in short.token_ids)
    full = generate(model, tokenizer, prompts, tau=0.5, max_new_tokens=64)
    assert all(tokenizer.eos_token_id not in ids for ids in full.token_ids)


def test_continuous_refill_equals_one_batch(trained_checkpoints, prompts):
    """Under adaptive width, which is per row; the auto limit's text follows the batch (costs.py)."""
    model, tokenizer = trained_checkpoints["mars64"]
    per_row = dict(tau=0.9, max_new_tokens=40, mask_batch_limit=None)
    all_at_once = generate(model, tokenizer, prompts, **per_row)
    two_at_a_time = generate(model, tokenizer, prompts, batch_size=2, **per_row)
    assert two_at_a_time.token_ids == all_at_once.token_ids


@pytest.mark.parametrize("mode", ["threshold", "lossless"])
def test_a_joining_prompt_is_prefilled_apart(trained_checkpoints, prompts, mode):
    """A prompt that joins running rows caches in a forward of its own, so the step that follows
    stays as narrow as a decoding step, and the answers are those of each prompt decoded alone."""
    model, tokenizer = trained_checkpoints["mars64"]
    by_length = sorted(prompts, key=len)
    short, middle, long_ = by_length[0], by_length[len(by_length) // 2], by_length[-1]
    assert len(short) < len(middle) < len(long_)
    params = DecodingParams(tau=0.9, mode=mode, block_size=4, max_new_tokens=24).validate()
    facts = checkpoint_facts(model, tokenizer)
    batch = DecodeBatch(
        model, mask_token_id=facts.mask_token_id, stop_ids=stop_token_ids(tokenizer), pad_id=facts.pad_id
    )
    fed = []
    handle = model.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        batch.add([short], [params], ["short"])
        batch.step()
        fed.clear()
        batch.add([middle, long_], [params, params], ["middle", "long"])
        rows = batch.step()
        assert fed[0] == (2, len(long_) - 1)  # the joining prompts, less their last token
        assert fed[1][0] == 3 and fed[1][1] <= 2 * 4 + 1  # then an ordinary step: pending, drafts, masks
        while len(batch):
            rows += batch.step()
    finally:
        handle.remove()
    alone = {
        name: generate(
            model, tokenizer, [p], tau=0.9, mode=mode, block_size=4, max_new_tokens=24, mask_batch_limit=None
        ).token_ids[0]
        for name, p in (("short", short), ("middle", middle), ("long", long_))
    }
    assert {r.request_id: r.token_ids for r in rows} == alone


def test_threshold_rows_feed_no_draft_columns(trained_checkpoints, prompts):
    """Drafts are lossless mode's: a threshold row feeds its pending tokens and masks only, so at
    batch 1 the cache never has holes and every step is plain causal (no explicit mask)."""
    model, tokenizer = trained_checkpoints["mars64"]
    masks = []
    handle = model.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    try:
        out = generate(model, tokenizer, prompts[:1], tau=0.7, max_new_tokens=48, **PAPER_RULE)
    finally:
        handle.remove()
    assert out.tokens_per_forward > 1.2
    assert all(mask is None for mask in masks)


def test_cursor_cache_holes_are_bounded(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    out = generate(model, tokenizer, prompts, tau=0.6, max_new_tokens=64, use_last_mask=True)
    longest = max(len(p) for p in prompts) + 64 + 5
    assert out.stats.peak_cache_slots <= 2 * longest + 8


def test_leaving_rows_are_replaced_from_the_end(trained_checkpoints, prompts):
    """A leaving row's place goes to the last row (the cache copies one row, not all of them), and
    a row that joins into a place another request used decodes as if alone."""
    model, tokenizer = trained_checkpoints["mars64"]
    params = DecodingParams(tau=0.9, block_size=4, max_new_tokens=24).validate()
    facts = checkpoint_facts(model, tokenizer)
    batch = DecodeBatch(
        model, mask_token_id=facts.mask_token_id, stop_ids=stop_token_ids(tokenizer), pad_id=facts.pad_id
    )
    names = ["a", "b", "c", "d"]
    batch.add(prompts[:4], [params] * 4, names)
    rows = batch.step() + batch.step()
    batch.cancel(["b"])
    assert batch.request_ids == ["a", "d", "c"]
    batch.add([prompts[4]], [params], ["e"])
    while len(batch):
        rows += batch.step()
    alone = generate(
        model,
        tokenizer,
        [prompts[i] for i in (0, 2, 3, 4)],
        tau=0.9,
        block_size=4,
        max_new_tokens=24,
        mask_batch_limit=None,
    )
    assert {r.request_id: r.token_ids for r in rows} == dict(zip("acde", alone.token_ids))


def test_no_masks_above_the_batch_limit(trained_checkpoints, prompts):
    """While more rows run than ``mask_batch_limit``, a step feeds no mask; at or below it, masks
    come back."""
    model, tokenizer = trained_checkpoints["mars64"]
    facts = checkpoint_facts(model, tokenizer)
    params = DecodingParams(tau=0.7, block_size=4, max_new_tokens=40).validate()
    batch = DecodeBatch(
        model,
        mask_token_id=facts.mask_token_id,
        stop_ids=stop_token_ids(tokenizer),
        pad_id=facts.pad_id,
        mask_batch_limit=2,
    )
    fed = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"]), with_kwargs=True)
    try:
        batch.add(prompts[:4], [params] * 4, list("abcd"))
        batch.step(), batch.step()
        above = len(fed)
        batch.cancel(["b", "c"])
        batch.step(), batch.step()
    finally:
        handle.remove()
    assert not any((ids == facts.mask_token_id).any() for ids in fed[:above])
    assert all((ids == facts.mask_token_id).any() for ids in fed[above:])


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_the_batch_limit_is_checked(trained_checkpoints, prompts, limit):
    model, tokenizer = trained_checkpoints["mars64"]
    with pytest.raises(UserError, match="mask_batch_limit"):
        generate(model, tokenizer, prompts[:1], tau=0.9, max_new_tokens=4, mask_batch_limit=limit)


def test_stats_count_what_masked_steps_bought(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    out = generate(model, tokenizer, prompts[:3], tau=0.7, max_new_tokens=32, **PAPER_RULE)
    stats = out.stats
    assert stats.masked_row_steps > 0 and stats.masked_row_tokens > stats.masked_row_steps
    assert stats.masked_row_tokens <= sum(map(len, out.token_ids)) + len(prompts[:3])  # stop tokens count
    plain = generate(model, tokenizer, prompts[:3], tau=1.0, max_new_tokens=32).stats
    assert plain.masked_row_steps == plain.masked_row_tokens == 0


def test_a_drafting_rows_first_masked_step_counts_nowhere(trained_checkpoints, prompts):
    """What a lossless row's masks buy shows in the step that verifies their drafts: its first step,
    which only drafts, counts nowhere (so a probe of one masked step does not read as buying one
    token); its later steps count, drafts kept or not."""
    model, tokenizer = trained_checkpoints["mars64"]
    out = generate(model, tokenizer, prompts[:1], mode="lossless", max_new_tokens=32, **PAPER_RULE)
    assert out.stats.masked_row_steps == out.forwards[0] - 1
    assert out.stats.masked_row_tokens == sum(out.accepted_per_step[0][1:])
    threshold = generate(model, tokenizer, prompts[:1], tau=0.7, max_new_tokens=32, **PAPER_RULE)
    assert threshold.stats.masked_row_steps == threshold.forwards[0]
