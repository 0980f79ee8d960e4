"""Stop strings: the text ends just before the first one, whether a step brought one token or
several, and when a stop string spans two steps; no streamed piece ever shows text past it."""

from __future__ import annotations

import pytest

from marslm import generate
from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.decode import DecodingParams, ParamError, TextStream
from tests.trained import TRAIN_N

TEXT = "3 plus 4 is 7. The answer is 7."


def chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        out.append(ids[i : i + size])
        i += size
    return out + ([ids[i:]] if i < len(ids) else [])


@pytest.mark.parametrize("sizes", [[1] * 40, [3] * 14, [5, 1, 7, 2, 9], [40]])
@pytest.mark.parametrize(
    "stop,expected",
    [((". The",), "3 plus 4 is 7"), (("is",), "3 plus 4 "), (("answer", "7."), "3 plus 4 is "), (("nowhere",), TEXT)],
)
def test_text_stream_ends_before_the_first_stop_string(tiny_tokenizer, sizes, stop, expected):
    ids = tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream = TextStream(tiny_tokenizer, stop)
    shown = ""
    for piece in chunks(ids, sizes):
        shown += stream.push(piece)
        assert expected.startswith(shown)  # never past the stop, at any point
    shown += stream.finish()
    assert shown == expected == stream.text
    assert stream.stopped == (expected != TEXT)
    covered = tiny_tokenizer.decode(ids[: stream.token_count()], skip_special_tokens=True)
    assert expected.startswith(covered) and len(expected) - len(covered) < 8


def test_text_stream_without_stops_streams_everything(tiny_tokenizer):
    ids = tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream = TextStream(tiny_tokenizer)
    shown = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert shown == TEXT and stream.token_count() == len(ids)


@pytest.mark.parametrize("stop", [("a",) * 5, ("",), (3,)])
def test_bad_stop_lists_are_refused(stop):
    with pytest.raises(ParamError) as err:
        DecodingParams(stop=stop).validate()
    assert err.value.param == "stop"


def test_generate_stops_on_strings_mid_step(trained_checkpoints):
    """On the trained checkpoint at tau 0.6 steps accept several tokens; the stop string must still
    end each answer right before it, as if the full answer were cut afterwards."""
    model, tokenizer = trained_checkpoints["mars64"]
    prompts = [encode_prompt(tokenizer, ex.messages) for ex in toy.make_split("train", TRAIN_N, seed=0)[:12]]
    # no auto batch limit: rows that stop early change the batch's size, which would change its text
    common = dict(tau=0.6, max_new_tokens=64, mask_batch_limit=None)
    full = generate(model, tokenizer, prompts, **common)
    assert max(max(s) for s in full.accepted_per_step) > 1
    stop = (" ", "\n")
    cut = generate(model, tokenizer, prompts, stop=stop, **common)
    for whole, text, ids, forwards, all_forwards in zip(
        full.texts, cut.texts, cut.token_ids, cut.forwards, full.forwards
    ):
        ends = [i for i in (whole.find(s) for s in stop) if i >= 0]
        assert text == (whole[: min(ends)] if ends else whole)
        assert text.startswith(tokenizer.decode(ids, skip_special_tokens=True))
        assert forwards <= all_forwards  # the row ended early, not after decoding everything
    assert sum(cut.forwards) < sum(full.forwards)


def test_close_returns_the_tokens_the_stopped_text_covers(tiny_tokenizer):
    ids = tiny_tokenizer.encode("12 + 34 = 46", add_special_tokens=False)
    stream = TextStream(tiny_tokenizer, ("=",))
    assert not stream.found_stop(ids[:1])
    kept = stream.close(ids)
    assert stream.stopped and stream.text == "12 + 34 "
    assert tiny_tokenizer.decode(kept) == "12 + 34 " and len(kept) < len(ids)
    assert TextStream.cut("12 + 34 = 46", ("4", "+")) == "12 "
