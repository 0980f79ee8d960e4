"""MaskBatchLimit: masks at a batch size while what they buy exceeds what they cost there."""

import math

from marslm.decode.costs import PRIOR_WEIGHT, PROBE_EVERY, PROBE_SHARE, PROBE_STEPS, MaskBatchLimit
from marslm.decode.rows import BatchStats


def test_the_limit_follows_what_masks_buy():
    limit = MaskBatchLimit({1: 1.2, 8: 1.6, 32: 2.4}, prior=1.5, weight=1.0)
    assert limit.limit == 1  # 1.5 tokens buy a 1.2x step only
    limit.observe(rows=8, tokens=16)  # 2 tokens per row
    assert limit.limit == 8
    limit.observe(rows=4, tokens=12)
    assert limit.limit == 32
    limit.observe(rows=4, tokens=4)  # masks bought nothing: they pay at no batch size
    assert limit.limit == 0
    limit.observe(rows=0, tokens=0)  # no masked step: nothing learned
    assert limit.bought == 1.0


def test_what_masks_buy_is_a_running_mean():
    limit = MaskBatchLimit({1: 1.1, 2: 1.3}, prior=1.0, weight=0.5)
    limit.observe(rows=1, tokens=2)
    assert limit.bought == 1.5 and limit.limit == 2


class _Batch:
    """What MaskBatchLimit.step reads of a DecodeBatch: ``rows`` rows that read their masks whenever
    the limit lets them, accepting ``accept`` tokens each in such a step. ``drafting``: as a
    drafting row's, a masked step right after one without masks counts nowhere (it only drafts)."""

    def __init__(self, accept: int, rows: int = 1, drafting: bool = False):
        self.stats = BatchStats()
        self.mask_batch_limit = None
        self.accept, self.rows, self.drafting = accept, rows, drafting
        self.limits = []

    def __len__(self):
        return self.rows

    def step(self):
        masked = self.mask_batch_limit >= self.rows
        drafts = bool(self.limits) and self.limits[-1] >= self.rows  # masks last step: drafts to verify now
        self.limits.append(self.mask_batch_limit)
        if masked and (drafts or not self.drafting):
            self.stats.masked_row_steps += self.rows
            self.stats.masked_row_tokens += self.accept * self.rows
        return []


def test_masks_that_pay_nowhere_rest_and_are_tried_once_in_probe_every_steps():
    limit = MaskBatchLimit({1: 1.2, 8: 1.6}, prior=1.0, weight=0.5)
    batch = _Batch(accept=1)
    for _ in range(2 * PROBE_EVERY + 4):
        limit.step(batch)
    assert limit.limit == 0
    tried = [i for i, b in enumerate(batch.limits) if b >= 1]
    # the prior is a guess: a try at once, then one after each PROBE_EVERY steps at rest; two steps each
    assert tried == [0, 1, PROBE_EVERY + 2, PROBE_EVERY + 3]
    assert batch.limits[tried[0]] == 1  # a try reads masks at the batch size that runs


def test_a_try_that_buys_enough_turns_masks_back_on():
    limit = MaskBatchLimit({1: 1.2, 8: 1.6}, prior=1.0, weight=0.5)
    batch = _Batch(accept=3)
    for _ in range(PROBE_EVERY + 1):
        limit.step(batch)
    assert limit.limit == 8  # the try bought 3 tokens: the mean is 2.0
    limit.step(batch)
    assert batch.limits[-1] == 8


def fed_to(model, call) -> list:
    """Every forward's input ids while ``call()`` runs."""
    fed = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"]), with_kwargs=True)
    try:
        call()
    finally:
        handle.remove()
    return fed


def test_the_cost_curve_feeds_an_exact_model_masks_where_a_step_does(trained_dirs):
    """The adapter acts at masks alone, so on random tokens its cost would go unmeasured."""
    import marslm
    from marslm.adapter import adapter_of
    from marslm.decode.cost_curve import cost_curve
    from marslm.modeling import checkpoint_facts

    model, _ = marslm.load(str(trained_dirs["dir"] / "exact"))
    mask_id = adapter_of(model).spec.mask_token_id
    fed = fed_to(model, lambda: cost_curve(model, widths=(1, 6), contexts=(8,), repeats=1, progress=False))
    steps = [ids for ids in fed if ids.shape[1] in (1, 6)]
    assert steps and all((ids[:, 1:] == mask_id).all() for ids in steps)
    assert all((ids[:, :1] != mask_id).all() for ids in fed)
    plain, tokenizer = marslm.load(str(trained_dirs["dir"] / "mars"))  # full mode: no adapter to engage
    plain_mask = checkpoint_facts(plain, tokenizer).mask_token_id
    fed = fed_to(plain, lambda: cost_curve(plain, widths=(6,), contexts=(8,), repeats=1, progress=False))
    assert not any((ids[:, 1:] == plain_mask).all() for ids in fed)


def test_the_first_masked_steps_replace_the_prior():
    """The prior weighs as PRIOR_WEIGHT observations: a few steps' tokens outweigh it."""
    limit = MaskBatchLimit({1: 1.2, 8: 1.7}, prior=1.5, weight=0.05)
    limit.observe(rows=8, tokens=24)
    assert limit.bought == (PRIOR_WEIGHT * 1.5 + 3) / (PRIOR_WEIGHT + 1) and limit.limit == 8
    for _ in range(50):
        limit.observe(rows=8, tokens=8)
    assert limit.bought < 1.1 and limit.limit == 0


def test_a_batch_above_the_limit_is_probed_and_masks_that_pay_there_come_on():
    """A prior (or a noisy cost) that puts the limit below the running batch size would leave masks
    off there for good, with nothing observed: the batch reads them in a probe, at once while the
    limit has observed nothing, which observes that they pay; then they stay on."""
    limit = MaskBatchLimit({1: 1.2, 8: 1.6}, prior=1.5)
    batch = _Batch(accept=3, rows=8)
    assert limit.limit == 1
    for _ in range(4):
        limit.step(batch)
    assert batch.limits == [8, 8, 8, 8] and limit.limit == 8


def test_a_probe_costs_at_most_its_share_of_the_time():
    limit = MaskBatchLimit({1: 1.2, 8: 1.6, 32: 4.0}, prior=1.0)
    assert limit.probe_wait(1) == PROBE_EVERY  # a cheap step: the floor
    assert limit.probe_wait(20) == math.ceil(PROBE_STEPS * 3.0 / PROBE_SHARE)  # priced at the next measured size, 32
    assert limit.probe_wait(64) == limit.probe_wait(32)  # above them all: the largest's cost
    batch = _Batch(accept=1, rows=32)
    for _ in range(3 * limit.probe_wait(32)):
        limit.step(batch)
    premium = sum(limit.cost_at(32) - 1 for b in batch.limits if b >= 32)
    assert 1 <= sum(b >= 32 for b in batch.limits) and premium <= PROBE_SHARE * len(batch.limits)


def test_no_probe_where_no_masked_step_could_pay():
    limit = MaskBatchLimit({1: 1.2, 8: 9.0}, prior=1.5, most=9)
    batch = _Batch(accept=9, rows=8)
    for _ in range(3 * limit.probe_wait(8)):
        limit.step(batch)
    assert set(batch.limits) == {1}
    assert MaskBatchLimit({1: 1.2, 8: 8.9}, prior=1.5, most=9).next_limit(8) == 8


def test_a_drafting_batch_is_probed_for_two_steps():
    """A drafting row's first masked step only drafts; the probe goes on to the step that verifies
    the drafts, which shows what they buy."""
    limit = MaskBatchLimit({1: 1.2, 8: 1.25}, prior=1.0, weight=0.5)
    batch = _Batch(accept=3, rows=8, drafting=True)
    for _ in range(3):
        limit.step(batch)
    assert batch.limits == [8, 8, 8]
    assert limit.bought == 2.5 and limit.limit == 8  # the probe's second step: 2.0; then 2.5


def test_a_probe_that_observes_nothing_ends_and_the_wait_starts_over():
    limit = MaskBatchLimit({1: 1.2, 8: 1.25}, prior=1.0)
    batch = _Batch(accept=3, rows=8)
    batch.step = lambda: batch.limits.append(batch.mask_batch_limit) or []  # one-token rows: nothing fed
    for _ in range(2 * PROBE_EVERY + 4):
        limit.step(batch)
    probes = [i for i, b in enumerate(batch.limits) if b == 8]
    assert probes == [0, 1, PROBE_EVERY + 2, PROBE_EVERY + 3]


def test_the_compiled_cost_curve_runs_the_compiled_step_and_compares_it_to_eager(trained_dirs, monkeypatch):
    """``--cost-curve --compile``: each width through the compiled step (a graph per width, with
    masks where a step puts them), then as a ratio to the eager one-token step."""
    import marslm
    from marslm.adapter import adapter_of
    from marslm.bench.report import format_against_eager
    from marslm.decode import forward
    from marslm.decode.cost_curve import cost_curve
    from marslm.decode.costs import table_from_curve

    monkeypatch.setattr(forward, "BACKEND", "eager")
    model, _ = marslm.load(str(trained_dirs["dir"] / "exact"))
    mask_id = adapter_of(model).spec.mask_token_id
    settings = dict(widths=(1, 5, 9), contexts=(8,), repeats=1, progress=False)
    eager = cost_curve(model, **settings)
    compiled = {}
    fed = fed_to(model, lambda: compiled.update(cost_curve(model, compile=True, **settings)))
    assert compiled["compiled"] and not eager["compiled"]
    assert [r["width"] for r in compiled["rows"]] == [1, 5, 9] and all(r["ms"] > 0 for r in compiled["rows"])
    steps = [ids for ids in fed if ids.shape[1] in (5, 9)]
    assert steps and all((ids[:, 1:] == mask_id).all() for ids in steps)
    assert table_from_curve(compiled, 4)["costs"]  # a masked step (B + 2 = 6 columns) is padded to 9
    assert "| 1 | 8 |" in format_against_eager(eager, compiled)
