"""MaskBatchLimit: masks at a batch size while what they buy exceeds what they cost there."""

from marslm.decode.costs import MaskBatchLimit


def test_the_limit_follows_what_masks_buy():
    limit = MaskBatchLimit({1: 1.2, 8: 1.6, 32: 2.4}, prior=1.5, weight=1.0)
    assert limit.limit == 1  # 1.5 tokens buy a 1.2x step only
    limit.observe(rows=8, tokens=16)  # 2 tokens per row
    assert limit.limit == 8
    limit.observe(rows=4, tokens=12)
    assert limit.limit == 32
    limit.observe(rows=4, tokens=4)  # masks bought nothing: back to the floor
    assert limit.limit == 1
    limit.observe(rows=0, tokens=0)  # no masked step: nothing learned
    assert limit.bought == 1.0


def test_what_masks_buy_is_a_running_mean():
    limit = MaskBatchLimit({1: 1.1, 2: 1.3}, prior=1.0, weight=0.5)
    limit.observe(rows=1, tokens=2)
    assert limit.bought == 1.5 and limit.limit == 2
