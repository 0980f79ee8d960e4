"""The decoding rules (rules.py), the per-row state (rows.py) and the decoder's options, each alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from marslm.decode import DecoderOptions, DecodingParams
from marslm.decode.params import METRICS, metric_code, one_token, one_token_rows
from marslm.decode.rows import RowState
from marslm.decode.rules import back_off, cut_at_stop, verify_drafts
from marslm.errors import UserError


def test_rest_backs_off_after_refused_steps_and_one_accepted_mask_ends_it():
    misses, pause, pauses = np.zeros(1, np.int64), np.zeros(1, np.int64), []
    for _ in range(6):  # every try refused: rest 1, 2, 4, 8 steps after the second miss on
        misses, pause = back_off(misses, pause, tried=np.ones(1, np.int64), used=np.zeros(1, np.int64))
        pauses.append(int(pause[0]))
    assert pauses == [0, 1, 2, 4, 8, 16]
    misses, pause = back_off(misses, pause, tried=np.ones(1, np.int64), used=np.ones(1, np.int64))
    assert misses[0] == 0 and pause[0] == 15  # the streak ends; the rest already begun runs out


def test_drafts_are_verified_up_to_the_first_mismatch():
    ar = np.array([[5, 6, 7, 8], [5, 9, 7, 8]])
    verified, after = verify_drafts(ar, np.array([[5, 6, 0], [5, 6, 7]]), np.ones((2, 3), bool))
    assert verified.tolist() == [2, 1] and after.tolist() == [7, 9]


def test_a_step_ends_at_its_first_accepted_stop_token():
    candidates = np.array([[1, 2, 9, 3], [9, 1, 1, 1], [1, 1, 1, 9]])
    accept, stopped = cut_at_stop(candidates, np.array([4, 4, 3]), np.array([9]))
    assert accept.tolist() == [3, 1, 3] and stopped.tolist() == [True, True, False]


@pytest.mark.parametrize("tau, metric, one", [(1.0, "prob", True), (0.99, "margin", False), (0.0, "entropy", True)])
def test_one_token_mode_is_one_rule_for_a_setting_and_for_rows(tau, metric, one):
    assert one_token(tau, metric) is one
    assert one_token(tau, metric, "lossless") is False
    assert bool(one_token_rows(np.array([tau]), np.array([metric_code(metric)]))[0]) is one
    assert bool(one_token_rows(torch.tensor([tau]), torch.tensor([metric_code(metric)]))[0]) is one


def test_metric_codes_are_the_places_of_the_metric_names():
    assert [metric_code(m) for m in METRICS] == list(range(len(METRICS)))


def test_every_row_field_joins_and_leaves_together():
    """A field declared in RowState is stacked by ``extend`` and indexed by ``keep``: none is left behind."""
    params = DecodingParams(tau=0.9, max_new_tokens=5, seed=3).validate()
    rows = RowState.empty()
    join = dict(pad_id=0, use_last_mask=True, slots=0)
    rows.extend(RowState.joining([[1, 2, 3], [4]], [params, params], ["a", "b"], np.array([3, 3]), **join))
    rows.extend(RowState.joining([[5, 6]], [params], ["c"], np.array([3]), **join))
    assert all(len(getattr(rows, f.name)) == 3 for f in dataclasses.fields(rows))
    rows.keep(np.array([0, 2]), "cpu")
    assert rows.request_ids == ["a", "c"] and rows.prompt_len.tolist() == [3, 2]
    assert all(len(getattr(rows, f.name)) == 2 for f in dataclasses.fields(rows))


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(cache="block-level"), "cache must be one of"),
        (dict(block_cache_size=0), "block_cache_size must be >= 1"),
        (dict(mask_batch_limit=0), "mask_batch_limit"),
    ],
)
def test_decoder_options_are_checked_when_made(options, fragment):
    with pytest.raises(UserError, match=fragment):
        DecoderOptions(**options)


def test_the_block_cache_refuses_what_it_cannot_decode():
    with pytest.raises(UserError, match="block cache"):
        DecoderOptions(cache="block").validate(DecodingParams(mode="lossless").validate())
    DecoderOptions(cache="block").validate(DecodingParams(tau=0.9).validate())


def test_generate_routes_keywords_and_checks_the_trained_block_size(make_tiny_model, tiny_tokenizer):
    from marslm import generate

    model = make_tiny_model()
    prompts = [[5, 6, 7]]
    by_object = generate(model, tiny_tokenizer, prompts, DecodingParams(max_new_tokens=4), DecoderOptions(cache="none"))
    by_keyword = generate(model, tiny_tokenizer, prompts, max_new_tokens=4, cache="none")
    assert by_object.token_ids == by_keyword.token_ids
    with pytest.raises(TypeError, match="tua"):
        generate(model, tiny_tokenizer, prompts, tua=0.9)
    with pytest.raises(UserError, match="block size must be in 1..4"):  # no marslm.json: the default B
        generate(model, tiny_tokenizer, prompts, tau=0.9, block_size=5, max_new_tokens=4)
