"""One decoder interface (decoder.py): every decoder steps a forward at a time behind it, one loop
drives them all, and a decoding mode is two entries (params.MODE_SPECS, rules.ACCEPTANCE).

Float64 trained checkpoints (tests/trained.py) on memorised prompts, where masks are confident.
"""

import numpy as np
import pytest

from marslm import generate
from marslm.decode import DecoderOptions, DecodingParams, make_decoder
from marslm.decode.decoder import free_rows
from marslm.decode.params import MODE_SPECS, Mode
from marslm.decode.rules import ACCEPTANCE, Rule, threshold_tries
from marslm.errors import UserError


def facts(tokenizer):
    return dict(mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"), pad_id=tokenizer.pad_token_id, stop_ids=[2])


def step_through(decoder, prompts, params):
    """Drive ``decoder`` by hand: ``(finished rows by request, tokens streamed by request, forwards per step)``."""
    decoder.add(prompts, [params] * len(prompts), list(range(len(prompts))))
    finished, streamed, forwards = {}, {i: [] for i in range(len(prompts))}, []
    while len(decoder):
        before = decoder.stats.forwards
        for row in decoder.step():
            finished[row.request_id] = row
        forwards.append(decoder.stats.forwards - before)
        for rid, ids in decoder.new_tokens().items():
            streamed[rid] += ids
    return finished, streamed, forwards


@pytest.mark.parametrize("cache", ["block", "cursor"])
def test_every_step_is_one_forward_and_streams_what_it_accepted(trained_checkpoints, prompts, cache):
    model, tokenizer = trained_checkpoints["mars64"]
    params = DecodingParams(tau=0.9, max_new_tokens=24).validate(4)
    options = DecoderOptions(cache=cache, block_cache_size=8)
    finished, streamed, forwards = step_through(make_decoder(model, options, **facts(tokenizer)), prompts, params)
    assert set(forwards) == {1}
    whole = generate(model, tokenizer, prompts, params, options)
    assert [finished[i].token_ids for i in range(len(prompts))] == whole.token_ids
    for i, row in finished.items():  # what streamed is the answer, the step that ended a row aside
        assert row.token_ids[: len(streamed[i])] == streamed[i]
        assert sum(row.accepted_per_step) >= len(row.token_ids)


def test_rows_join_the_block_cache_only_when_it_is_empty(trained_checkpoints, prompts):
    model, tokenizer = trained_checkpoints["mars64"]
    decoder = make_decoder(model, DecoderOptions(cache="block"), **facts(tokenizer))
    params = DecodingParams(tau=0.9, max_new_tokens=8).validate(4)
    assert free_rows(decoder, 4) == 4
    decoder.add(prompts[:2], [params] * 2, [0, 1])
    decoder.step()
    assert free_rows(decoder, 4) == 0
    with pytest.raises(ValueError, match="join an empty batch"):
        decoder.add(prompts[2:3], [params], [2])
    assert [row.request_id for row in decoder.stop([0])] == [0] and len(decoder) == 1
    decoder.cancel([1])
    assert len(decoder) == 0 and free_rows(decoder, 4) == 4
    decoder.add(prompts[2:3], [params], [2])  # an emptied batch starts afresh
    while len(decoder):
        rows = decoder.step()
    assert rows[0].request_id == 2 and rows[0].token_ids


def test_a_row_stopped_from_outside_sits_out_the_block_cache(trained_checkpoints, prompts):
    """A row stopped from outside takes no further part: it accepts nothing more, and the others
    decode as they would without it."""
    model, tokenizer = trained_checkpoints["mars64"]
    params = DecodingParams(tau=0.9, max_new_tokens=24).validate(4)
    options = DecoderOptions(cache="block", block_cache_size=8)
    alone, _, _ = step_through(make_decoder(model, options, **facts(tokenizer)), prompts[1:2], params)
    pair = make_decoder(model, options, **facts(tokenizer))
    pair.add([prompts[0], prompts[1]], [params] * 2, ["stopped", 0])
    pair.step()  # the prefill
    assert [row.request_id for row in pair.stop(["stopped"])] == ["stopped"]
    pair.step()  # a fill step
    assert pair.accept_log[0] == [] and pair.accept_log[1]
    while len(pair):
        rows = pair.step()
    assert rows[0].token_ids == alone[0].token_ids


@pytest.mark.parametrize("decoding", [dict(cache="block"), dict(drafter=True)])
def test_stop_strings_end_every_decoder_s_answer(trained_checkpoints, prompts, decoding):
    """The loop matches stop strings for any decoder: the block cache and a draft model end an
    answer where the cursor cache does (tau 1: each is greedy AR decoding)."""
    model, tokenizer = trained_checkpoints["mars64"]
    plain = generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=16)
    stops = [text[len(text) // 2 : len(text) // 2 + 2] for text in plain.texts if len(text) > 4][:1]
    assert stops and stops[0].strip()
    expected = generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=16, stop=stops)
    assert any(a != b for a, b in zip(expected.texts, plain.texts))  # the stop string cut something
    kw = dict(draft_model=trained_checkpoints["ar64"][0]) if decoding.get("drafter") else decoding
    out = generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=16, stop=stops, **kw)
    assert out.texts == expected.texts


def first_mask_rule(out, rows_of):
    """A toy mode: the AR token and the first mask's prediction, however unsure."""
    reads = out.masks_read > 0
    return out.predicted[:, [0, out.first_mask]], np.where(reads, 2, 1)


def test_a_new_mode_is_its_facts_and_its_rule(trained_checkpoints, prompts, monkeypatch):
    """The two entries docs/architecture.md names are all a mode needs: it decodes through
    ``generate``, mixed in one batch with the built-in modes."""
    model, tokenizer = trained_checkpoints["mars64"]
    with pytest.raises(UserError, match="mode must be one of"):
        generate(model, tokenizer, prompts, mode="first-mask", max_new_tokens=8)
    monkeypatch.setitem(MODE_SPECS, "first-mask", Mode(drafts=False, reads_tau=False, samples=False, help="toy"))
    monkeypatch.setitem(ACCEPTANCE, "first-mask", Rule(first_mask_rule, threshold_tries))
    out = generate(model, tokenizer, prompts, mode="first-mask", max_new_tokens=12)
    for steps, ids in zip(out.accepted_per_step, out.token_ids):
        assert steps[:-1] == [2] * (len(steps) - 1) and len(ids) <= 2 * len(steps)
    # its second token is the first mask's prediction, which greedy AR decoding need not agree with;
    # its first is always the AR token: decoding one token per step from the same prefix agrees
    greedy = generate(model, tokenizer, prompts, tau=1.0, max_new_tokens=12)
    assert [ids[:1] for ids in out.token_ids] == [ids[:1] for ids in greedy.token_ids]
    with pytest.raises(UserError, match="decodes greedily"):
        generate(model, tokenizer, prompts, mode="first-mask", temperature=0.7, max_new_tokens=4)

    from marslm.decode.generation import run_to_completion
    from marslm.decode.run_loop import RunLoop

    batch = make_decoder(model, DecoderOptions(), **facts(tokenizer))
    modes = ["first-mask", "lossless", "threshold", "hybrid"]
    params = [DecodingParams(mode=m, tau=0.9, max_new_tokens=12).validate(4) for m in modes]
    mixed = run_to_completion(RunLoop(batch), prompts, params)
    assert mixed[0].token_ids == out.token_ids[0]
    assert mixed[1].token_ids == greedy.token_ids[1]  # lossless beside it is still greedy AR


def test_jacobi_decoding_is_a_decoder_and_greedy(trained_checkpoints, prompts):
    from marslm.decode.jacobi import jacobi_generate
    from tests.helpers import hf_greedy

    model, tokenizer = trained_checkpoints["ar64"]
    out = jacobi_generate(model, tokenizer, prompts, window=3, max_new_tokens=12, apply_chat_template=False)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts, 12)
    assert sum(out.forwards) < sum(map(len, out.token_ids)) + len(prompts)  # some fixed points held
