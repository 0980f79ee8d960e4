"""A MARS checkpoint as the separate drafter (drafters.py ``MarsDrafter``, the paper's section 4.6:
a MARS draft model drafts several tokens per forward under its own tau).

The float64 trained checkpoints of tests/trained.py: the MARS model drafts (for itself, or for its
AR parent); on memorised prompts its masks are confident, so its forwards draft several tokens.
"""

import pytest
import torch

from marslm import generate
from marslm.decode import PAPER_RULE, DecodingParams
from marslm.decode.draft_model import DraftModelDecoder, make_drafter
from marslm.decode.drafters import ARDrafter, MarsDrafter
from marslm.decode.params import DEFAULT_DRAFT_TAU
from marslm.errors import UserError
from marslm.modeling import checkpoint_facts
from tests.cli.test_errors import assert_one_line_error, run
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

GREEDY = DecodingParams(max_new_tokens=64).validate(4)


@pytest.fixture(scope="module")
def mars(trained_checkpoints):
    """``(model, tokenizer, mask id, masks per drafter forward)``: B = 4, the last mask used."""
    model, tokenizer = trained_checkpoints["mars64"]
    return model, tokenizer, checkpoint_facts(model, tokenizer).mask_token_id, 4


def drafter(mars, tau):
    model, _, mask, n_masks = mars
    return MarsDrafter(model, mask, tau, n_masks)


def test_at_tau_1_a_mars_drafter_drafts_greedy_ar_one_token_per_forward(mars, prompts):
    model, tokenizer, _, _ = mars
    one = drafter(mars, 1.0)
    drafts = one.propose(prompts[0], 10, GREEDY, None)
    expected = hf_greedy(model, tokenizer, prompts[:1], 10)[0]  # up to its EOS
    assert len(drafts) == 10 and drafts[: len(expected)] == expected
    assert one.forwards == 10


@pytest.mark.parametrize("tau", [0.9, 0.5])
def test_a_mars_drafter_drafts_what_threshold_decoding_of_the_same_model_emits(mars, prompts, tau):
    """Its forwards are the threshold mode's steps under the paper's rule (pending tokens, then every
    mask, which no later forward sees), so its drafts are that decoding's first tokens, in fewer
    forwards than tokens."""
    model, tokenizer, _, _ = mars
    forwards = 0
    for prompt in prompts:
        many = drafter(mars, tau)
        drafts = many.propose(prompt, 16, GREEDY, None)
        expected = generate(model, tokenizer, [prompt], tau=tau, max_new_tokens=16, **PAPER_RULE).token_ids[0]
        assert len(drafts) == 16 and drafts[: len(expected)] == expected
        assert many.cached == (prompt + drafts)[: len(many.cached)]
        assert many.cache.get_seq_length() == len(many.cached)  # no mask's keys/values
        forwards += many.forwards
    assert forwards < 16 * len(prompts) * (0.8 if tau < 0.9 else 1)  # several drafts per forward


class CheckedMarsDrafter(MarsDrafter):
    """Checks every proposal against a fresh drafter with an empty cache, and that its cache holds
    exactly a prefix of the text and drafts: a rejected draft, or a mask, left in it fails."""

    def propose(self, ids, k, params, race):
        self.rejected = getattr(self, "rejected", 0) + (self.cached != ids[: len(self.cached)])
        drafts = super().propose(ids, k, params, race)
        fresh = MarsDrafter(self.model, self.mask_token_id, self.tau, self.n_masks)
        assert drafts == fresh.propose(ids, k, params, race)
        assert self.cached == (ids + drafts)[: len(self.cached)] and len(self.cached) >= len(ids)
        assert self.cache.get_seq_length() == len(self.cached)
        self.drafted = getattr(self, "drafted", 0) + k
        return drafts


def test_a_rejected_draft_rolls_the_mars_drafter_cache_back(mars, trained_checkpoints, prompts):
    """The AR parent verifies the MARS model's drafts, tau 0.3: many kept, many rejected."""
    target = trained_checkpoints["ar64"][0]
    checked = CheckedMarsDrafter(mars[0], mars[2], 0.3, mars[3])
    stop = [mars[1].eos_token_id]
    decoder = DraftModelDecoder(target, checked, 4, mask_token_id=None, stop_ids=stop, use_last_mask=True)
    params = DecodingParams(max_new_tokens=40).validate(4)
    rows = [decoder.run_row(prompt, params, i) for i, prompt in enumerate(prompts)]
    assert rows[0].token_ids == hf_greedy(target, mars[1], prompts[:1], 40)[0]
    assert checked.rejected > 3 and max(s for row in rows for s in row.accepted_per_step) == 5
    assert checked.forwards < checked.drafted  # several drafts per drafter forward


@pytest.mark.parametrize("draft", ["mars", "bad-mars", "mars-low-tau"])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_verification_with_a_mars_drafter_equals_hf_greedy(trained_checkpoints, prompts, bad_mars, draft, k):
    model, tokenizer = trained_checkpoints["mars64"]
    chosen = bad_mars if draft == "bad-mars" else model
    tau = 0.3 if draft == "mars-low-tau" else None
    out = generate(model, tokenizer, prompts, max_new_tokens=40, draft_model=chosen, num_draft_tokens=k, draft_tau=tau)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 40)


@pytest.fixture(scope="module")
def bad_mars(trained_checkpoints):
    """A random model of the MARS tokenizer: the target's tokenizer names its mask token."""
    from marslm.demo.toy_model import make_tiny_qwen2

    return make_tiny_qwen2(trained_checkpoints["mars64"][1], "test", seed=5).double().eval()


class CountingMarsDrafter(MarsDrafter):
    def propose(self, ids, k, params, race):
        self.drafted = getattr(self, "drafted", 0) + k
        return super().propose(ids, k, params, race)


def test_speculative_sampling_with_a_mars_drafter_is_the_target_distribution(tiny_vocab_model, other_vocab_model):  # noqa: F811
    """The drafter samples its AR output and its confident masks: the output is distributed as
    sampling the target alone (chi-square against the enumerated one)."""
    exact = exact_distribution(tiny_vocab_model)
    mars_drafter = CountingMarsDrafter(other_vocab_model, MASK, 0.05, 2)  # every mask passes: q rows of masks
    decoder = DraftModelDecoder(
        tiny_vocab_model, mars_drafter, 2, mask_token_id=MASK, stop_ids=[99], use_last_mask=True
    )
    params = DecodingParams(temperature=1.0, block_size=3, max_new_tokens=NEW, seed=1).validate()
    samples, steps = [], 0
    for i in range(DRAWS):
        row = decoder.run_row(PROMPT, DecodingParams(**{**params.__dict__, "seed": i}), i)
        samples.append(tuple(row.token_ids))
        steps += len(row.accepted_per_step)
    assert steps < NEW * DRAWS  # some drafts kept
    assert mars_drafter.forwards < 0.8 * mars_drafter.drafted  # masks drafted
    for positions in ((0, 1), (1, 2), (2,), (0, 1, 2)):
        observed, expected = marginals(samples, exact, positions)
        assert chi_square_p(observed, expected, DRAWS) > 1e-3, positions


def test_each_sampled_draft_is_its_own_outputs_race_winner_at_its_position(other_vocab_model):
    """The AR output's distribution drafts the first position, then each confident mask's the
    next, each raced with the noise of its own position (the noise the target races it with)."""
    from marslm.decode.draws import RowDraws

    mars_drafter = MarsDrafter(other_vocab_model, MASK, 0.05, 2)
    params = DecodingParams(temperature=0.7, block_size=3, max_new_tokens=NEW, seed=1).validate()
    draws, raced = RowDraws("cpu"), []

    def race(probs, positions):
        raced.append((probs, list(positions)))
        return draws.race(probs, 11, positions)

    drafts = mars_drafter.propose(PROMPT, 3, params, race)
    with torch.no_grad():
        logits = other_vocab_model(input_ids=torch.tensor([PROMPT + [MASK, MASK]])).logits[0, len(PROMPT) - 1 :]
    q = (logits.float() / 0.7).softmax(-1)
    assert mars_drafter.forwards == 1 and len(raced) == 1 and raced[0][1] == [3, 4, 5]
    torch.testing.assert_close(raced[0][0], q)
    assert drafts == [int(draws.race(q[i : i + 1], 11, [3 + i])[0]) for i in range(3)]


def test_which_drafter_a_draft_model_makes(trained_checkpoints, bad_drafter):
    model, tokenizer = trained_checkpoints["mars64"]
    ar, ar_tokenizer = trained_checkpoints["ar64"]
    default = make_drafter((model, None), tokenizer, None, use_last_mask=True)
    assert type(default) is MarsDrafter and default.tau == DEFAULT_DRAFT_TAU and default.n_masks == 4
    assert make_drafter((model, tokenizer), tokenizer, 0.7, use_last_mask=False).n_masks == 3
    assert type(make_drafter((ar, None), tokenizer, None, True)) is ARDrafter  # an AR stage
    # no marslm.json: the tokenizer's mask token (the toy tokenizer has one from the start)
    assert type(make_drafter((bad_drafter, ar_tokenizer), tokenizer, None, True)) is MarsDrafter


@pytest.mark.parametrize(
    ("draft", "draft_tau", "fragment"),
    [
        ("ar", 0.5, "draft_tau is a MARS drafter's; this draft model is an AR model"),
        (None, 0.5, "no draft model was given"),
        ("mars", 1.5, "draft_tau: tau for the prob metric must be in (0, 1], got 1.5"),
        ("mars", 0.0, "draft_tau: tau for the prob metric must be in (0, 1], got 0.0"),
    ],
)
def test_draft_tau_refusals(trained_checkpoints, prompts, draft, draft_tau, fragment):
    model, tokenizer = trained_checkpoints["mars64"]
    draft_model = {"ar": trained_checkpoints["ar64"][0], "mars": model, None: None}[draft]
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        generate(model, tokenizer, prompts, draft_model=draft_model, draft_tau=draft_tau)


def test_cli_draft_tau(trained_checkpoints, capsys):
    import json

    mars_dir, ar_dir = trained_checkpoints["mars_dir"], trained_checkpoints["ar_dir"]
    base = ["generate", "--model", mars_dir, "--prompt", "What is 3 plus 4?", "--max-new-tokens", 16, "--tau", 1]
    base.append("--json")
    rc, out, err = run(capsys, *base, "--draft-model", mars_dir, "--draft-tau", 0.5)
    assert rc == 0, err
    plain = run(capsys, *base)[1]
    assert json.loads(out)["text"] == json.loads(plain)["text"] and json.loads(out)["drafter_forwards"] > 0
    rc, _, err = run(capsys, *base, "--draft-model", ar_dir, "--draft-tau", 0.5)
    assert_one_line_error(rc, err, "draft_tau is a MARS drafter's")
    rc, _, err = run(capsys, *base, "--draft-tau", 0.5)
    assert_one_line_error(rc, err, "--draft-tau needs --draft-model")
