"""MaskBatchLimit: masks at a batch size while what they buy exceeds what they cost there."""

from marslm.decode.costs import PROBE_EVERY, MaskBatchLimit
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
    """What MaskBatchLimit.step reads of a DecodeBatch: one row that reads its masks whenever the
    limit lets it, accepting ``accept`` tokens in such a step."""

    def __init__(self, accept: int):
        self.stats = BatchStats()
        self.mask_batch_limit = None
        self.accept = accept
        self.limits = []

    def step(self):
        self.limits.append(self.mask_batch_limit)
        if self.mask_batch_limit >= 1:
            self.stats.masked_row_steps += 1
            self.stats.masked_row_tokens += self.accept
        return []


def test_masks_that_pay_nowhere_rest_and_are_tried_once_in_probe_every_steps():
    limit = MaskBatchLimit({1: 1.3, 8: 1.6}, prior=1.0, weight=0.5)
    batch = _Batch(accept=1)
    for _ in range(3 * PROBE_EVERY + 3):
        limit.step(batch)
    assert limit.limit == 0
    tried = [i for i, b in enumerate(batch.limits) if b >= 1]
    assert tried == [PROBE_EVERY, 2 * PROBE_EVERY + 1, 3 * PROBE_EVERY + 2]  # each try, then 16 rests
    assert batch.limits[tried[0]] == 1  # a try reads masks where one row runs, the cheapest step


def test_a_try_that_buys_enough_turns_masks_back_on():
    limit = MaskBatchLimit({1: 1.3, 8: 1.6}, prior=1.0, weight=0.5)
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
    from marslm.decode.costs import cost_curve
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
