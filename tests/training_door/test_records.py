"""Rule 2 of issue 36: every data record is validated once, with its file and line, and message
text is text: a literal "<|im_end|>" in a message is not the control token."""

from __future__ import annotations

import json

import pytest

from marslm.chat import IGNORE, encode_conversation, encode_prompt
from marslm.errors import UserError
from marslm.training.config import TrainConfig
from marslm.training.dataset import generated_answers
from tests.test_train_reliability import run_cli

MESSAGES = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7"}]


def _record(i, **fields):
    return {"id": f"p{i}", "source": "chat", "messages": MESSAGES, "answer_ids": [20, 21], "finished": True, **fields}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _answers(tmp_path, data, vocab_size=306, **options):
    cfg = TrainConfig(stage="mars", model="m", data=str(data), output=str(tmp_path / "o"), **options)
    return generated_answers(cfg, vocab_size)


@pytest.mark.parametrize(
    "answer_ids, shown",
    [
        ([20, 306], "306"),  # out of the vocabulary
        ([20, -1], "-1"),
        ([10**30], str(10**30)),
        ("123", "got str"),  # a string is no list: it would train as the ids 1, 2, 3
        ([20, 2.0], "2.0"),
        ([True], "True"),
        ([20, None], "None"),
        (None, "missing"),
    ],
    ids=["out-of-vocab", "negative", "overflow", "string", "float", "bool", "null-id", "null"],
)
def test_bad_answer_ids_are_refused_with_file_and_line(tmp_path, answer_ids, shown):
    data = _write(tmp_path / "d.jsonl", [_record(0), _record(1, answer_ids=answer_ids)])
    with pytest.raises(UserError, match=r"d\.jsonl:2: 'answer_ids'") as refused:
        _answers(tmp_path, data)
    assert shown in str(refused.value)


def test_a_missing_answer_ids_key_is_refused(tmp_path):
    record = _record(1)
    del record["answer_ids"]
    data = _write(tmp_path / "d.jsonl", [_record(0), record])
    with pytest.raises(UserError, match=r"d\.jsonl:2: 'answer_ids' must be a list of token ids \(missing\)"):
        _answers(tmp_path, data)


@pytest.mark.parametrize("messages", [None, "hello", {"role": "user"}], ids=["missing", "a-string", "a-dict"])
def test_a_cut_answer_without_a_messages_list_is_refused(tmp_path, messages):
    from marslm.data.distilled import unfinished_path

    data = _write(tmp_path / "d.jsonl", [_record(0)])
    cut = _record(1, finished=False, messages=messages)
    if messages is None:
        del cut["messages"]
    _write(unfinished_path(data), [_record(2, finished=False), cut])
    with pytest.raises(UserError, match=r"d\.unfinished\.jsonl:2: a distill record needs a 'messages' list"):
        _answers(tmp_path, data, cut_answers=True)


def test_duplicate_distill_ids_are_refused(tmp_path):
    data = _write(tmp_path / "d.jsonl", [_record(0), _record(1), _record(0)])
    with pytest.raises(UserError, match=r"d\.jsonl:3: id 'p0' repeats the record at .*d\.jsonl:1"):
        _answers(tmp_path, data)


def test_bad_answer_ids_stop_the_cli_in_one_line_before_training(tiny_model_dir, tmp_path):
    data = _write(tmp_path / "d.jsonl", [_record(0), _record(1, answer_ids=[20, 10**6])])
    out = tmp_path / "out"
    rc, _, err = run_cli("train", "mars", "--model", tiny_model_dir, "--data", data, "-o", out, "--quiet")
    assert rc == 2 and "d.jsonl:2: 'answer_ids' holds 1000000" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out.partial").exists()


def test_a_literal_control_token_in_an_answer_is_text(tiny_tokenizer):
    """An answer quoting "<|im_end|>" keeps its turn going: the text is not the end-of-turn token."""
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    quoted = [MESSAGES[0], {"role": "assistant", "content": "say <|im_end|> now"}]
    enc = encode_conversation(tiny_tokenizer, quoted)
    answer = [t for t in enc.labels if t != IGNORE]
    assert answer.count(end) == 1 and answer[-1] == end  # only the template's own end of turn
    assert tiny_tokenizer.decode(answer[:-1]) == "say <|im_end|> now"
    plain = encode_conversation(tiny_tokenizer, MESSAGES)  # text without control tokens: as before
    assert (
        plain.input_ids
        == tiny_tokenizer(tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ][: len(plain.input_ids)]
    )


def test_a_literal_control_token_in_a_prompt_is_text(tiny_tokenizer):
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode_prompt(tiny_tokenizer, "stop<|im_end|>here")
    assert ids.count(end) == 1  # the template's end of the user turn, not the user's text


def test_the_probe_refuses_out_of_vocabulary_answer_ids_in_one_line(tiny_tokenizer):
    from marslm.eval.probe_items import probe_item

    record = _record(0, answer_ids=[20, len(tiny_tokenizer)])
    with pytest.raises(UserError, match=r"d\.jsonl:7: 'answer_ids' holds \d+; token ids are integers in 0\.\."):
        probe_item(record, tiny_tokenizer, "d.jsonl:7")
