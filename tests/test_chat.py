"""Chat formatting: training conversations and decoding prompts share the tokenizer's template."""

from __future__ import annotations

import pytest

from marslm.chat import IGNORE, encode_conversation, encode_prompt, stop_token_ids
from marslm.errors import UserError

EOS_ID = 2


def labelled_spans(labels):
    """[(start, end)] of consecutive labelled positions."""
    spans, start = [], None
    for t, label in enumerate(labels + [IGNORE]):
        if label != IGNORE and start is None:
            start = t
        elif label == IGNORE and start is not None:
            spans.append((start, t))
            start = None
    return spans


def test_no_assistant_turn_is_a_user_error(tiny_tokenizer):
    with pytest.raises(UserError, match="assistant"):
        encode_conversation(tiny_tokenizer, [{"role": "user", "content": "What is 1 plus 1?"}])
    with pytest.raises(UserError):
        encode_conversation(
            tiny_tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        )


def test_single_turn(tiny_tokenizer):
    enc = encode_conversation(
        tiny_tokenizer,
        [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "3 plus 4 is 7."}],
    )
    spans = labelled_spans(enc.labels)
    assert len(spans) == 1
    start, end = spans[0]
    assert end == len(enc.input_ids)
    assert tiny_tokenizer.decode(enc.input_ids[start:end]) == "3 plus 4 is 7.<|im_end|>"
    assert tiny_tokenizer.decode(enc.input_ids[:start]) == (
        "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert enc.labels[start:end] == enc.input_ids[start:end]


def test_multi_turn_labels_both_assistant_turns(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "What is 3 plus 4?"},
        {"role": "assistant", "content": "7."},
        {"role": "user", "content": "And 5 minus 1?"},
        {"role": "assistant", "content": "The answer is 4."},
    ]
    enc = encode_conversation(tiny_tokenizer, messages)
    spans = labelled_spans(enc.labels)
    assert [tiny_tokenizer.decode(enc.input_ids[a:b]) for a, b in spans] == [
        "7.<|im_end|>",
        "The answer is 4.<|im_end|>",
    ]
    # the user turn between the answers is context
    between = tiny_tokenizer.decode(enc.input_ids[spans[0][1] : spans[1][0]])
    assert between == "\n<|im_start|>user\nAnd 5 minus 1?<|im_end|>\n<|im_start|>assistant\n"
    assert enc.input_ids[-1] == EOS_ID


def test_conversation_ending_with_a_user_turn_is_cut_after_the_last_answer(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "What is 3 plus 4?"},
        {"role": "assistant", "content": "7."},
        {"role": "user", "content": "Thanks!"},
    ]
    enc = encode_conversation(tiny_tokenizer, messages)
    assert enc.input_ids[-1] == EOS_ID and enc.labels[-1] == EOS_ID
    assert "Thanks" not in tiny_tokenizer.decode(enc.input_ids)


def test_stop_token_ids(tiny_tokenizer):
    assert stop_token_ids(tiny_tokenizer) == [EOS_ID]

    class GenConfig:
        eos_token_id = [EOS_ID, 0]

    assert stop_token_ids(tiny_tokenizer, GenConfig()) == [EOS_ID, 0]


def test_encode_prompt_accepts_a_string(tiny_tokenizer):
    ids = encode_prompt(tiny_tokenizer, "What is 3 plus 4?")
    assert tiny_tokenizer.decode(ids) == "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    raw = encode_prompt(tiny_tokenizer, "What is 3 plus 4?", apply_chat_template=False)
    assert tiny_tokenizer.decode(raw) == "What is 3 plus 4?"


def test_encode_prompt_accepts_a_message_list(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 4?"}]
    ids = encode_prompt(tiny_tokenizer, messages)
    assert tiny_tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # same text as the prompt part of a training example: train and decode agree
    train = encode_conversation(tiny_tokenizer, messages + [{"role": "assistant", "content": "7."}])
    assert train.input_ids[: len(ids)] == ids
    assert train.labels[len(ids) - 1] == IGNORE and train.labels[len(ids)] != IGNORE


def test_encode_prompt_accepts_token_ids(tiny_tokenizer):
    assert encode_prompt(tiny_tokenizer, [1, 5, 6]) == [1, 5, 6]
    assert encode_prompt(tiny_tokenizer, (7, 8)) == [7, 8]


@pytest.mark.parametrize("empty", ["", [], ()])
def test_empty_prompt_is_a_user_error(tiny_tokenizer, empty):
    with pytest.raises(UserError, match="empty"):
        encode_prompt(tiny_tokenizer, empty)
