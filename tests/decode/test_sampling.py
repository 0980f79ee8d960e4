"""Sampling: lossless mode at temperature > 0 samples exactly the AR model's distribution, top-k /
top-p as transformers applies them, and a seed gives one text whatever the batch and whatever was
drafted (draws.py: each position's draw is an exponential race of the row's seed and the position).

The distribution test runs a tiny random model with a 6-token vocabulary: its distributions are
spread out, and its masks (untrained) propose something quite unlike the AR model, so many drafts
are rejected and the target's own draws carry much of the probability mass. The exact
distribution of the first three tokens is computed by enumeration and compared with a chi-square
test.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from marslm import generate
from marslm.decode import PAPER_RULE, DecodeBatch, DecodingParams
from marslm.decode import draws as draws_module
from marslm.decode.rows import RowState
from marslm.decode.rules import next_draft
from marslm.decode.sampling import sampling_probs
from tests.helpers import tiny_llama

VOCAB, MASK, PROMPT = 6, 5, [0, 1, 2]
NEW = 3
DRAWS = 4000


@pytest.fixture(scope="module")
def tiny_vocab_model():
    return tiny_llama(VOCAB, hidden_size=32, num_hidden_layers=2, seed=4, head_scale=6.0)


def exact_distribution(model) -> dict[tuple, float]:
    """P(first NEW tokens) of plain sampling at temperature 1, by enumerating every prefix."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + list(seq)])).logits[0].double()
        p = 1.0
        for i, token in enumerate(seq):
            p *= float(logits[len(PROMPT) - 1 + i].softmax(-1)[token])
        probs[seq] = p
    return probs


def sample_lossless(model, draws: int, seed: int) -> list[tuple]:
    batch = DecodeBatch(model, mask_token_id=MASK, stop_ids=[99], seed=seed)
    params = DecodingParams(mode="lossless", temperature=1.0, block_size=3, max_new_tokens=NEW).validate()
    batch.add([PROMPT] * draws, [params] * draws, list(range(draws)))
    rows = []
    while len(batch):
        rows += batch.step()
    assert sum(len(r.accepted_per_step) for r in rows) < NEW * draws  # some steps kept a draft
    return [tuple(r.token_ids) for r in sorted(rows, key=lambda r: r.request_id)]


def chi_square_p(observed: dict, expected: dict, total: int) -> float:
    """Goodness-of-fit p-value, cells with fewer than 5 expected draws pooled; Wilson-Hilferty tail."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, p in expected.items():
        if p * total >= 5:
            cells.append((observed.get(key, 0), p * total))
        else:
            pooled_obs, pooled_exp = pooled_obs + observed.get(key, 0), pooled_exp + p * total
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    k = len(cells) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def marginals(samples, exact, positions):
    observed, expected = {}, {}
    for seq in samples:
        key = tuple(seq[i] for i in positions)
        observed[key] = observed.get(key, 0) + 1
    for seq, p in exact.items():
        key = tuple(seq[i] for i in positions)
        expected[key] = expected.get(key, 0.0) + p
    return observed, expected


def test_lossless_sampling_is_the_ar_distribution(tiny_vocab_model):
    exact = exact_distribution(tiny_vocab_model)
    assert sum(exact.values()) == pytest.approx(1.0)
    samples = sample_lossless(tiny_vocab_model, DRAWS, seed=1)
    for positions in ((0, 1), (1, 2), (2,), (0, 1, 2)):
        observed, expected = marginals(samples, exact, positions)
        assert chi_square_p(observed, expected, DRAWS) > 1e-3, positions


def test_noise_shared_across_positions_fails_the_same_test(tiny_vocab_model, monkeypatch):
    """Racing every position of a row with the same noise ties its tokens to each other: the test
    above must see it."""
    exact = exact_distribution(tiny_vocab_model)
    monkeypatch.setattr(draws_module, "position_seed", lambda seed, position: seed)
    samples = sample_lossless(tiny_vocab_model, DRAWS, seed=1)
    worst = min(
        chi_square_p(*marginals(samples, exact, positions), DRAWS) for positions in ((0, 1), (1, 2), (2,), (0, 1, 2))
    )
    assert worst < 1e-3


def test_a_seed_gives_the_same_text_whatever_was_drafted(trained_checkpoints, prompts):
    """Lossless sampling is plain sampling at the same seed, token for token, whether every step
    drafts, rows rest from their drafts, or steps read no masks while the batch is above a limit:
    the fallback's decisions (under the default auto limit, this machine's timings) cannot change
    a seeded sample."""
    model, tokenizer = trained_checkpoints["mars64"]
    sampled = dict(temperature=1.0, top_p=0.95, seed=21, max_new_tokens=40)
    plain = generate(model, tokenizer, prompts, **sampled).token_ids  # tau 1: one token per step
    reach = []
    decoders = (PAPER_RULE, dict(mask_batch_limit=None), dict(mask_batch_limit=1), {})  # {}: the default, auto
    for decoder in decoders:
        drafted = generate(model, tokenizer, prompts, mode="lossless", **sampled, **decoder)
        assert drafted.token_ids == plain, decoder
        reach.append(drafted.tokens_per_forward)
    assert reach[0] > 1.1 and reach[2] < reach[0]  # drafts kept; fewer where the batch stays above the limit


def test_a_seed_gives_the_same_sample_whatever_the_batch(tiny_vocab_model):
    def run(prompts, seeds):
        batch = DecodeBatch(tiny_vocab_model, mask_token_id=MASK, stop_ids=[99])
        params = [
            DecodingParams(mode=m, temperature=0.8, top_p=0.9, block_size=3, max_new_tokens=12, seed=s).validate()
            for m, s in seeds
        ]
        batch.add(prompts, params, list(range(len(prompts))))
        rows = []
        while len(batch):
            rows += batch.step()
        return {r.request_id: r.token_ids for r in rows}

    alone = run([PROMPT], [("lossless", 7)])[0]
    crowded = run([[3, 1], PROMPT, [2, 2, 2, 4]], [("threshold", 1), ("lossless", 7), ("lossless", 8)])[1]
    assert alone == crowded
    assert run([PROMPT], [("lossless", 9)])[0] != alone  # another seed, another sample


def test_top_k_and_top_p_match_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(3, 2, 50) * 3
    settings = [(0.7, 0.9, 5), (1.3, 0.5, 0), (1.0, 1.0, 10)]
    ours = sampling_probs(
        logits,
        torch.tensor([s[0] for s in settings]),
        torch.tensor([s[1] for s in settings]),
        torch.tensor([s[2] for s in settings]),
    )
    for row, (temperature, top_p, top_k) in enumerate(settings):
        scores = TemperatureLogitsWarper(temperature)(None, logits[row].clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        torch.testing.assert_close(ours[row], scores.softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["threshold", "lossless"])
def test_settings_at_their_limits_decode_as_the_limit_does(tiny_vocab_model, mode):
    """A temperature too small to divide logits by is greedy decoding, and a top_k beyond every
    vocabulary keeps every token, as 0 does: neither may overflow (NaN probabilities, a top_k that
    no 64-bit integer holds)."""

    def run(**settings):
        batch = DecodeBatch(tiny_vocab_model, mask_token_id=MASK, stop_ids=[99])
        params = DecodingParams(mode=mode, block_size=3, max_new_tokens=12, seed=5, **settings).validate()
        batch.add([PROMPT], [params], [0])
        rows = []
        while len(batch):
            rows += batch.step()
        return rows[0].token_ids

    greedy = run(temperature=0.0)
    for temperature in (1e-38, 1e-45):
        assert run(temperature=temperature) == greedy, temperature
    sampled = run(temperature=1.0)
    for top_k in (2**63, 2**70):
        assert run(temperature=1.0, top_k=top_k) == sampled, top_k


def test_a_sampled_draft_is_drawn_at_the_position_it_drafts():
    """Draft j of a row whose text ends at seq_len drafts position seq_len + j, where the next step
    races the target's token (batch.py): drawn with that position's noise, a draft the target
    would sample is kept. Drawn at another position's, the text stays the target's (the test above)
    but fewer drafts are kept."""
    settings = [DecodingParams(mode="lossless", temperature=1.0, block_size=4, max_new_tokens=8).validate()] * 2
    rows = RowState.joining(
        [[1, 2], [1, 2, 3]], settings, [0, 1], np.array([5, 6]), pad_id=0, use_last_mask=False, slots=0
    )
    rows.seq_len = np.array([7, 9])
    probs = torch.full((2, 1 + 3, VOCAB), 1 / VOCAB)  # the AR token's column, then one group of 3 masks
    drawn_at = []

    def draw(q, selected, positions):
        drawn_at.append(positions.reshape(2, 3).tolist())
        return np.zeros(len(selected), np.int64)

    mask_tokens = np.zeros((2, 1, 3), np.int64)
    _, draft_len = next_draft(
        rows, mask_tokens, np.zeros(2, np.int64), np.array([3, 3]), probs, draft_groups=False, draw=draw
    )
    assert draft_len.tolist() == [3, 3] and drawn_at == [[[7, 8, 9], [9, 10, 11]]]
