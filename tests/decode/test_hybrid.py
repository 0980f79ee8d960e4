"""Hybrid mode: lossless verification, then the threshold rule on the mask group verification
selected. The rule alone on hand-made arrays, then decoding on the trained tiny checkpoint (float64,
as test_batch.py: a mismatch is a real bug), then each place that refuses it."""

from __future__ import annotations

import numpy as np
import pytest

from marslm import generate
from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.decode import PAPER_RULE, DecodingParams
from marslm.decode.params import ParamError, metric_code
from marslm.decode.rows import RowState
from marslm.decode.rules import hybrid_accept, lossless_candidates, next_draft, verify_drafts
from marslm.errors import UserError
from tests.helpers import hf_greedy
from tests.trained import TRAIN_N

PROB = metric_code("prob")


def _rule(tau, group_conf, usable=(True, True, True), masks_read=(3, 3, 3)):
    """Three rows, two drafts each, verified 2, 1 and 0 of them; the selected group's 3 masks."""
    ar = np.array([[5, 6, 7], [5, 9, 7], [8, 6, 7]])
    draft = np.array([[5, 6], [5, 6], [5, 6]])
    verified, correction = verify_drafts(ar, draft, np.ones((3, 2), bool))
    candidates = lossless_candidates(draft, verified, correction, 2 + 3 + 1)
    group_tokens = np.array([[21, 22, 23], [31, 32, 33], [41, 42, 43]])
    tau = np.full(3, tau)
    out, accept = hybrid_accept(
        candidates,
        verified,
        group_tokens,
        np.array(group_conf, np.float32),
        np.array(usable),
        tau,
        np.full(3, PROB),
        np.array(masks_read),
    )
    return verified, candidates, out, accept


def test_hybrid_accepts_the_verified_drafts_then_the_confident_masks():
    conf = [[0.99, 0.97, 0.5], [0.5, 0.99, 0.99], [0.99, 0.99, 0.99]]
    verified, lossless, out, accept = _rule(0.9, conf)
    assert verified.tolist() == [2, 1, 0]
    assert accept.tolist() == [2 + 1 + 2, 1 + 1 + 0, 0 + 1 + 3]
    # what lossless accepts comes first, unchanged, then the group's masks
    assert [out[row, : accept[row]].tolist() for row in range(3)] == [[5, 6, 7, 21, 22], [5, 9], [8, 41, 42, 43]]
    assert all(out[row, : v + 1].tolist() == lossless[row, : v + 1].tolist() for row, v in enumerate(verified))


def test_hybrid_accepts_at_least_what_lossless_does_and_at_tau_1_exactly_that():
    rng = np.random.default_rng(0)
    for _ in range(50):
        conf = rng.uniform(0.5, 1.0, (3, 3))
        usable = tuple(rng.random(3) < 0.8)
        verified, _, _, accept = _rule(rng.uniform(0.5, 1.0), conf, usable)
        assert (accept >= verified + 1).all()  # lossless's count on the same step
        assert (accept <= verified + 1 + 3).all()
        _, _, _, at_one = _rule(1.0, np.ones((3, 3)), usable)
        assert at_one.tolist() == (verified + 1).tolist()


def test_a_group_without_the_kept_drafts_context_and_the_row_s_masks_bound_it():
    conf = np.full((3, 3), 0.99)
    _, _, _, accept = _rule(0.9, conf, usable=(False, True, True), masks_read=(3, 1, 0))
    assert accept.tolist() == [3, 2 + 1, 1]


def test_the_next_draft_is_the_rest_of_the_selected_group():
    settings = [DecodingParams(mode="hybrid", tau=0.9, block_size=4).validate() for _ in range(2)]
    rows = RowState.joining(
        [[1, 2], [1, 2]], settings, [0, 1], np.zeros(2, np.int64), pad_id=0, use_last_mask=False, slots=0
    )
    rows.draft, rows.draft_len = np.array([[5, 6], [5, 6]]), np.array([2, 2])
    mask_tokens = np.arange(2 * 3 * 3).reshape(2, 3, 3) + 100  # [rows, groups, masks]
    verified, taken = np.array([2, 1]), np.array([1, 0])
    draft, draft_len = next_draft(
        rows, mask_tokens, verified, np.array([3, 3]), None, draft_groups=True, draw=None, taken=taken
    )
    assert draft_len.tolist() == [2, 3]
    assert draft[0, :2].tolist() == [107, 108] and draft[1].tolist() == [112, 113, 114]


@pytest.fixture(scope="module")
def prompts(trained_checkpoints):
    _, tokenizer = trained_checkpoints["mars64"]
    examples = toy.make_split("train", TRAIN_N, seed=0)[::8]  # memorised prompts: confident masks
    return [encode_prompt(tokenizer, ex.messages) for ex in examples]


@pytest.mark.parametrize("cache", ["none", "cursor"])
@pytest.mark.parametrize("draft_groups", [False, True])
def test_hybrid_at_tau_1_equals_hf_greedy(trained_checkpoints, prompts, cache, draft_groups):
    model, tokenizer = trained_checkpoints["mars64"]
    expected = hf_greedy(model, tokenizer, prompts[:3], 48)
    kwargs = dict(cache=cache, draft_groups=draft_groups, max_new_tokens=48, mask_batch_limit=None)
    out = generate(model, tokenizer, prompts[:3], mode="hybrid", tau=1.0, **kwargs)
    lossless = generate(model, tokenizer, prompts[:3], mode="lossless", **kwargs)
    assert out.token_ids == expected
    assert out.accepted_per_step == lossless.accepted_per_step


@pytest.mark.parametrize("draft_groups", [False, True])
def test_hybrid_below_tau_1_reaches_further_than_lossless_and_caches_right(trained_checkpoints, prompts, draft_groups):
    model, tokenizer = trained_checkpoints["mars64"]
    kwargs = dict(draft_groups=draft_groups, max_new_tokens=48, **PAPER_RULE)  # every step reads its masks
    lossless = generate(model, tokenizer, prompts, mode="lossless", **kwargs)
    # where the confident masks agree with the AR argmax, verification would keep them a step later
    # anyway: hybrid gains where tau accepts what greedy verification would not, so a low tau shows it
    hybrid = generate(model, tokenizer, prompts, mode="hybrid", tau=0.5, **kwargs)
    oracle = generate(model, tokenizer, prompts, mode="hybrid", tau=0.5, cache="none", **kwargs)
    assert hybrid.tokens_per_forward > lossless.tokens_per_forward
    assert max(max(steps) for steps in hybrid.accepted_per_step) > max(max(s) for s in lossless.accepted_per_step)
    assert (hybrid.token_ids, hybrid.accepted_per_step) == (oracle.token_ids, oracle.accepted_per_step)
    # a ragged batch decodes each row as alone
    alone = generate(model, tokenizer, prompts[2:3], mode="hybrid", tau=0.5, **kwargs)
    assert alone.token_ids[0] == hybrid.token_ids[2]


def test_hybrid_rows_share_a_batch_with_the_other_modes(trained_checkpoints, prompts):
    from marslm.chat import stop_token_ids
    from marslm.decode import DecodeBatch
    from marslm.decode.generation import run_to_completion
    from marslm.decode.run_loop import RunLoop
    from marslm.modeling import checkpoint_facts

    model, tokenizer = trained_checkpoints["mars64"]
    facts = checkpoint_facts(model, tokenizer)
    modes = [dict(mode="hybrid", tau=0.8), dict(mode="lossless"), dict(tau=0.8), dict(mode="hybrid", tau=0.9)]
    params = [DecodingParams(max_new_tokens=40, **modes[i % 4]).validate(facts.block_size) for i in range(len(prompts))]
    batch = DecodeBatch(
        model,
        mask_token_id=facts.mask_token_id,
        stop_ids=stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
        pad_id=facts.pad_id,
    )
    mixed = run_to_completion(RunLoop(batch), prompts, params)
    for i, row in enumerate(mixed):
        alone = generate(model, tokenizer, [prompts[i]], max_new_tokens=40, mask_batch_limit=None, **modes[i % 4])
        assert row.token_ids == alone.token_ids[0], modes[i % 4]


@pytest.mark.parametrize(
    "overrides, param",
    [(dict(temperature=0.7), "temperature"), (dict(block_size=1), "block_size")],
)
def test_hybrid_refuses_sampling_and_a_block_without_masks(overrides, param):
    with pytest.raises(ParamError, match="hybrid mode") as info:
        DecodingParams(mode="hybrid", tau=0.9, **overrides).validate(4)
    assert info.value.param == param
    DecodingParams(mode="hybrid", tau=0.9, temperature=1e-6).validate(4)  # greedy in all but rounding


def test_the_block_cache_refuses_hybrid(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    with pytest.raises(UserError, match="block cache decodes greedily in threshold mode"):
        generate(model, tokenizer, prompts[:1], mode="hybrid", tau=0.9, cache="block")


def test_the_vllm_plugin_refuses_hybrid():
    from marslm.vllm.request_settings import check_request

    with pytest.raises(ParamError, match="not served by the vLLM plugin") as info:
        check_request({"mode": "hybrid", "tau": 0.9})
    assert info.value.param == "mode"


def test_a_step_packs_each_rows_uncached_tokens_and_drafts_together():
    """A row that accepted three tokens last step and drafts one is as wide as a row that accepted
    one and drafts three: both feed four real tokens, at consecutive positions, then the masks."""
    from marslm.decode.inputs import logits_to_keep, step_inputs

    prompts = [list(range(100, 110)), list(range(200, 210))]
    settings = [DecodingParams(mode="hybrid", tau=0.9, block_size=4, max_new_tokens=8)] * 2
    rows = RowState.joining(prompts, settings, [0, 1], np.zeros(2, np.int64), pad_id=0, use_last_mask=True, slots=10)
    rows.cached_len = np.array([7, 9])  # three tokens and one not cached
    rows.slot_valid[0, :7] = rows.slot_valid[1, :9] = True
    rows.draft, rows.draft_len = np.array([[51, 0, 0], [61, 62, 63]]), np.array([1, 3])
    masks = np.array([4, 4])
    step = step_inputs(rows, masks, draft_groups=False, pad_id=0, mask_token_id=9)
    assert step.input_ids.tolist() == [[107, 108, 109, 51, 9, 9, 9, 9], [209, 61, 62, 63, 9, 9, 9, 9]]
    assert step.position_ids.tolist() == [[7, 8, 9, 10, 11, 12, 13, 14], [9, 10, 11, 12, 13, 14, 15, 16]]
    # read: the AR output at the last token not cached, each draft's (a padding draft's: any), the masks
    assert step.read_cols[:, [0, 1]].tolist() == [[2, 3], [0, 1]] and step.read_cols[1, 1:4].tolist() == [1, 2, 3]
    assert step.read_cols[:, 4:].tolist() == [[4, 5, 6, 7]] * 2
    assert (step.mask[:, 0, :, 10:] == np.tri(8, dtype=bool)).all()  # causal over every fed token
    with_groups = step_inputs(rows, masks, draft_groups=True, pad_id=0, mask_token_id=9)
    fed = with_groups.mask[:, 0, :, 10:]
    # row 1's group 2 (after two of its drafts) sees its token not cached and those two drafts
    group2 = 4 + 2 * 4
    assert fed[1, group2, :4].tolist() == [True, True, True, False]
    # row 0's groups 0 and 1 see its three tokens not cached, and then its one draft
    assert fed[0, 4, :4].tolist() == [True, True, True, False] and fed[0, 8, :4].all()
    # rows that read different columns gather them; a row alone reads its last ones: their count
    assert logits_to_keep(step.read_cols, 8) is step.read_cols
    alone = step_inputs(
        RowState.joining(prompts[:1], settings[:1], [0], np.zeros(1, np.int64), pad_id=0, use_last_mask=True, slots=0),
        masks[:1],
        draft_groups=False,
        pad_id=0,
        mask_token_id=9,
    )
    assert logits_to_keep(alone.read_cols, alone.input_ids.shape[1]) == 5  # the AR token's output and 4 masks'
