"""A separate draft model composed with the MARS target (draft_model.py, the paper's section 4.6).

Float64 trained checkpoints (tests/trained.py): the MARS model is the target; its AR parent is a
good drafter (most drafts kept), a randomly initialised model of the same vocabulary a bad one
(most drafts rejected, so both caches roll back often). Through ``generate`` the random model is a
MARS drafter (the toy tokenizer has a mask token), whose masks never pass the default draft tau.
"""

import pytest
import torch
from transformers import DynamicCache

from marslm import generate
from marslm.decode import DecodingParams
from marslm.decode.draft_model import DraftModelDecoder
from marslm.decode.drafters import ARDrafter
from marslm.errors import UserError
from tests.decode.test_sampling import (
    DRAWS,
    MASK,
    NEW,
    PROMPT,
    chi_square_p,
    exact_distribution,
    marginals,
    tiny_vocab_model,  # noqa: F401 - a fixture
)
from tests.helpers import hf_greedy


class CheckedDrafter(ARDrafter):
    """Checks every proposal against the same drafter run from scratch, without a cache: a cache
    that kept a rejected draft's keys/values proposes something else."""

    def propose(self, ids, k, params, race):
        drafts = super().propose(ids, k, params, race)
        self.proposals += 1
        fed = torch.tensor([ids + drafts[:-1]])
        with torch.no_grad():
            fresh = self.model(input_ids=fed).logits[0, len(ids) - 1 :].argmax(-1).tolist()
        assert drafts == fresh
        assert len(self.cached) == len(ids) + k - 1
        assert_cache_of(self.cache, self.model, self.cached)  # no rejected draft's keys/values left
        return drafts

    def reset(self):
        super().reset()
        self.proposals = getattr(self, "proposals", 0)


def assert_cache_of(cache, model, ids):
    """``cache`` holds the keys and values of ``ids`` as one forward over them from scratch makes:
    not only as many, also the same (a stale rejected draft's at some position is not)."""
    fresh = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=fresh, use_cache=True)
    assert cache.get_seq_length() == len(ids)
    for kept, expected in zip(cache.layers, fresh.layers, strict=True):
        assert torch.allclose(kept.keys, expected.keys) and torch.allclose(kept.values, expected.values)


@pytest.mark.parametrize("drafter", ["ar", "bad"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_verification_equals_hf_greedy(trained_checkpoints, prompts, bad_drafter, drafter, k):
    model, tokenizer = trained_checkpoints["mars64"]
    draft = trained_checkpoints["ar64"][0] if drafter == "ar" else bad_drafter
    expected = hf_greedy(model, tokenizer, prompts, 40)
    out = generate(model, tokenizer, prompts, max_new_tokens=40, draft_model=draft, num_draft_tokens=k)
    assert out.token_ids == expected
    if drafter == "ar":  # good drafts: more than one token per target forward
        assert out.tokens_per_forward > 1.5
    assert out.stats.drafter_forwards > 0
    assert out.stats.forwards == sum(out.forwards)


def test_a_plain_ar_target_is_plain_speculative_decoding(trained_checkpoints, prompts, bad_drafter):
    model, tokenizer = trained_checkpoints["ar64"]
    out = generate(model, tokenizer, prompts, max_new_tokens=40, draft_model=bad_drafter, num_draft_tokens=2)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 40)


def test_the_drafter_cache_rolls_back_after_a_rejection(trained_checkpoints, prompts, bad_drafter):
    model, tokenizer = trained_checkpoints["mars64"]
    drafter = CheckedDrafter(bad_drafter)
    decoder = DraftModelDecoder(model, drafter, 3, mask_token_id=None, stop_ids=[], use_last_mask=True)
    params = DecodingParams(max_new_tokens=30).validate(4)
    row = decoder.run_row(prompts[0], params, 0)
    assert drafter.proposals > 5 and max(row.accepted_per_step) < 4  # drafts were rejected


def test_masks_after_verification_add_tokens(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    draft = trained_checkpoints["ar64"][0]
    common = dict(max_new_tokens=48, draft_model=draft, num_draft_tokens=2)
    plain = generate(model, tokenizer, prompts, tau=1.0, **common)
    composed = generate(model, tokenizer, prompts, tau=0.6, **common)
    assert composed.tokens_per_forward > plain.tokens_per_forward
    # a step reaches past K + 1 only through group j's masks
    assert max(max(s) for s in composed.accepted_per_step) > 3
    assert max(max(s) for s in plain.accepted_per_step) <= 3


def test_a_drafter_with_another_vocabulary_is_refused(trained_checkpoints, tiny_tokenizer, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    with pytest.raises(UserError, match="tokenizer differs"):
        generate(model, tokenizer, prompts, draft_model=model, draft_tokenizer=tiny_tokenizer)


def test_a_drafter_model_with_another_vocabulary_is_refused(trained_checkpoints, prompts, other_vocab_model):
    """Without a drafter tokenizer, the drafter model's output rows are checked: ids it proposes
    would be valid for the target, but mean other tokens."""
    model, tokenizer = trained_checkpoints["mars64"]
    with pytest.raises(UserError, match="draft model's vocabulary"):
        generate(model, tokenizer, prompts, max_new_tokens=4, draft_model=other_vocab_model)


def test_the_ar_parent_shares_the_vocabulary_but_the_mask_token(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    draft, draft_tokenizer = trained_checkpoints["ar64"]
    out = generate(model, tokenizer, prompts, max_new_tokens=8, draft_model=draft, draft_tokenizer=draft_tokenizer)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 8)


@pytest.mark.parametrize("setting", [dict(mode="lossless"), dict(cache="block")])
def test_settings_a_drafter_cannot_run_are_refused(trained_checkpoints, prompts, setting):
    model, tokenizer = trained_checkpoints["mars64"]
    draft = trained_checkpoints["ar64"][0]
    with pytest.raises(UserError, match="a draft model decodes"):
        generate(model, tokenizer, prompts, draft_model=draft, tau=0.9, **setting)


def test_the_number_of_drafts_is_checked(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    with pytest.raises(UserError, match="num_draft_tokens"):
        generate(model, tokenizer, prompts, draft_model=model, num_draft_tokens=0)


def test_speculative_sampling_is_the_target_distribution(tiny_vocab_model, other_vocab_model):  # noqa: F811
    """Drafts sampled from a different model, verified by speculative sampling: the output is
    distributed as sampling the target alone (chi-square against the enumerated distribution)."""
    exact = exact_distribution(tiny_vocab_model)
    decoder = DraftModelDecoder(
        tiny_vocab_model, ARDrafter(other_vocab_model), 2, mask_token_id=MASK, stop_ids=[99], use_last_mask=True
    )
    params = DecodingParams(temperature=1.0, block_size=3, max_new_tokens=NEW, seed=1).validate()
    samples, steps = [], 0
    for i in range(DRAWS):
        row = decoder.run_row(PROMPT, DecodingParams(**{**params.__dict__, "seed": i}), i)
        samples.append(tuple(row.token_ids))
        steps += len(row.accepted_per_step)
    assert steps < NEW * DRAWS  # some drafts kept
    for positions in ((0, 1), (1, 2), (2,), (0, 1, 2)):
        observed, expected = marginals(samples, exact, positions)
        assert chi_square_p(observed, expected, DRAWS) > 1e-3, positions


def test_the_masks_read_are_those_of_the_group_verification_selected():
    """One draft kept of two: group 1's masks (after draft 1) give the extra tokens, not group 0's."""
    vocab, n_masks = 10, 2
    decoder = DraftModelDecoder(torch.nn.Linear(1, 1), None, 2, mask_token_id=9, stop_ids=[], use_last_mask=False)
    rows = [3, 4, 6] + [5, 5] + [7, 8] + [1, 1]  # AR argmax at pending, draft 1, draft 2; groups 0, 1, 2
    logits = torch.nn.functional.one_hot(torch.tensor(rows), vocab).double() * 20
    params = DecodingParams(tau=0.5, block_size=3, max_new_tokens=10).validate()
    tokens, kept = decoder._accept(logits, [3, 2], n_masks, params, None, 0)
    assert (kept, tokens) == (1, [3, 4, 7, 8])


def test_without_a_seed_a_drafted_decode_draws_as_a_batch_does(trained_checkpoints, prompts):
    """Both decoders draw the rows that name no seed from one generator of torch's default seed
    (draws.py): an unseeded run repeats itself, and is the run seeded with that seed."""
    model, tokenizer = trained_checkpoints["mars64"]
    # no auto limit: a threshold sample at tau < 1 follows which steps read masks, which it decides
    sampled = dict(tau=0.8, temperature=1.5, max_new_tokens=30, mask_batch_limit=None)
    default = torch.Generator().initial_seed()
    for drafting in ({}, dict(draft_model=trained_checkpoints["ar64"][0])):
        runs = [
            generate(model, tokenizer, prompts[:1], **sampled, **drafting, **seed).token_ids
            for seed in ({}, {}, dict(seed=default), dict(seed=default + 1))
        ]
        assert runs[0] == runs[1] == runs[2] != runs[3], drafting


@pytest.mark.parametrize("idle", [dict(num_draft_tokens=4), dict(draft_tau=0.8), dict(draft_tokenizer="tok")])
def test_a_drafters_setting_without_a_drafter_is_refused(make_tiny_model, tiny_tokenizer, idle):
    """``generate`` with a drafter's setting but no draft_model: it would do nothing, so it is
    refused in one line (the default 4 drafts too, when asked for by name)."""
    with pytest.raises(UserError, match="would do nothing: no draft model") as refused:
        generate(make_tiny_model(), tiny_tokenizer, [[5, 6, 7]], max_new_tokens=4, **idle)
    assert "\n" not in str(refused.value) and next(iter(idle)) in str(refused.value)
