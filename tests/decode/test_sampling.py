"""Sampling: lossless mode at temperature > 0 samples exactly the AR model's distribution
(speculative sampling), top-k / top-p as transformers applies them, reproducible seeds.

The distribution test runs a tiny random model with a 6-token vocabulary: its distributions are
spread out, and its masks (untrained) propose something quite unlike the AR model, so the
acceptance rule's residual draws carry much of the probability mass. The exact distribution of
the first three tokens is computed by enumeration and compared with a chi-square test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from marslm.decode import DecodeBatch, DecodingParams
from marslm.decode import sampling as sampling_module
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


def test_a_biased_acceptance_fails_the_same_test(tiny_vocab_model, monkeypatch):
    """Redrawing a rejected draft from p instead of the residual max(0, p - q) biases the output
    towards what the masks propose: the test above must see it."""
    exact = exact_distribution(tiny_vocab_model)
    original = sampling_module.speculative_accept

    def biased(p, q, draft, draft_len, uniform):
        kept, _ = original(p, q, draft, draft_len, uniform)
        return kept, p.gather(1, kept[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]

    monkeypatch.setattr("marslm.decode.batch.speculative_accept", biased)
    samples = sample_lossless(tiny_vocab_model, DRAWS, seed=1)
    worst = min(
        chi_square_p(*marginals(samples, exact, positions), DRAWS) for positions in ((0, 1), (1, 2), (2,), (0, 1, 2))
    )
    assert worst < 1e-3


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
