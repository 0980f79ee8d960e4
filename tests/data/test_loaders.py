"""Loaders for real data: chat SFT JSONL in its common shapes, GSM8K and HumanEval evaluation files.

Every test writes its own small sample file; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest

from marslm.data import gsm8k, humaneval, load_conversations
from marslm.errors import UserError
from marslm.eval.sets import load_eval_set


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------- chat SFT shapes


def test_every_chat_shape_becomes_messages(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"instruction": "Add the numbers.", "input": "2 3", "output": "5"},
            {"instruction": "Say yes.", "input": "", "output": "yes", "system": "Be brief."},
            {"prompt": "Capital of France?", "completion": "Paris."},
            {
                "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                "completion": [{"role": "assistant", "content": "a"}],
            },
            {"conversations": [{"from": "human", "value": "ping"}, {"from": "gpt", "value": "pong"}]},
        ],
    )
    conversations = load_conversations(path)
    assert conversations == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "Add the numbers.\n\n2 3"}, {"role": "assistant", "content": "5"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say yes."},
            {"role": "assistant", "content": "yes"},
        ],
        [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}],
    ]
    assert load_conversations(path, n=2) == conversations[:2]


@pytest.mark.parametrize(
    "bad_record, message",
    [
        ('{"instruction": "x", "output": 5}', "needs a string 'output'"),
        ('{"text": "just text"}', "unknown record shape"),
        ('{"prompt": "q", "completion": ["a"]}', "both be strings or both message lists"),
        ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant turn"),
        ('{"conversations": [{"from": "alien", "value": "x"}]}', "ShareGPT turn"),
        ('{"prompt": "unterminated', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, bad_record, message):
    good = json.dumps({"prompt": "q", "completion": "a"})
    path = write_jsonl(tmp_path / "data.jsonl", [good, "", bad_record])
    with pytest.raises(UserError) as err:
        load_conversations(path)
    assert "data.jsonl:3: " in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_line_separators_inside_strings_are_text(tmp_path):
    # Valid JSON may hold these unescaped; str.splitlines would cut the record there.
    content = "a\u2028b\u2029c\u0085d"
    record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "raw.jsonl", [json.dumps(record, ensure_ascii=False)])
    assert "\u2028" in (tmp_path / "raw.jsonl").read_text(encoding="utf-8")
    assert load_conversations(path) == [record["messages"]]


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="no records"):
        load_conversations(str(empty))


# ---------------------------------------------------------------------------- GSM8K

GSM8K_RECORDS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A book costs $1,200. Two cost?", "answer": "2 * 1200 = 2400\n#### 2,400"},
    {"question": "Temperature drops 5 from 2?", "answer": "2 - 5 = -3\n#### -3"},
]


@pytest.mark.parametrize(
    "response, expected",
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("so it is 6, no wait: the answer is 7.", "7"),
        ("First 2, then 5, finally 12", "12"),
        ("The answer is $2,400.", "$2,400"),
        ("no digits here", None),
    ],
)
def test_final_number(response, expected):
    assert gsm8k.final_number(response) == expected


def test_gsm8k_loading_and_scoring(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_RECORDS)
    for source in (f"gsm8k:{path}", path):  # explicit, and detected from the first record
        eval_set = load_eval_set(source, n=10)
        assert eval_set.name == source
        assert [ex.family for ex in eval_set.examples] == ["gsm8k"] * 3
        assert eval_set.examples[0].messages == [{"role": "user", "content": GSM8K_RECORDS[0]["question"]}]
    responses = ["7 apples. #### 7", "They cost 2400 dollars.", "It is 3 degrees."]
    assert eval_set.score_many(eval_set.examples, responses) == [True, True, False]
    assert len(load_eval_set(path, n=2).examples) == 2


def test_gsm8k_bad_answer_line(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", [GSM8K_RECORDS[0], {"question": "q", "answer": "no marker"}])
    with pytest.raises(UserError, match=r"gsm\.jsonl:2: .*#### <number>"):
        load_eval_set(f"gsm8k:{path}")


# ---------------------------------------------------------------------------- HumanEval

HUMANEVAL_PROBLEMS = [
    {
        "task_id": "Test/0",
        "entry_point": "add",
        "prompt": 'import math\n\n\ndef add(a, b):\n    """Return a + b."""\n',
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    },
    {
        "task_id": "Test/1",
        "entry_point": "root",
        "prompt": 'import math\n\n\ndef root(x):\n    """Integer square root."""\n',
        "test": "def check(candidate):\n    assert candidate(16) == 4\n",
    },
]


def test_humaneval_completion_shapes():
    problem = HUMANEVAL_PROBLEMS[0]
    fenced = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert humaneval.completion_from_response(problem, fenced) == "\ndef add(a, b):\n    return a + b\n"
    body = "    return a + b\n"
    assert humaneval.completion_from_response(problem, body) == body


def test_humaneval_execution_contract():
    add, root = HUMANEVAL_PROBLEMS
    problems = [add, add, root, root, add]
    completions = [
        "    return a + b\n",  # body continuing the prompt
        "\ndef add(a, b):\n    return a - b\n",  # wrong redefinition
        "\ndef root(x):\n    return math.isqrt(x)\n",  # uses the prompt's import
        "    while True:\n        pass\n",  # never ends: the timeout fails it
        "    raise SystemExit(0)\n",  # exiting early is not passing
    ]
    verdicts = humaneval.run_checks(problems, completions, timeout=2.0)
    assert verdicts == [True, False, True, False, False]


def test_humaneval_eval_set(tmp_path):
    path = write_jsonl(tmp_path / "he.jsonl", HUMANEVAL_PROBLEMS)
    eval_set = load_eval_set(path)
    assert [ex.id for ex in eval_set.examples] == ["Test/0", "Test/1"]
    assert "def add(a, b):" in eval_set.examples[0].messages[0]["content"]
    responses = ["```python\ndef add(a, b):\n    return a + b\n```", "I don't know."]
    assert eval_set.score_many(eval_set.examples, responses) == [True, False]


def test_eval_data_errors(tmp_path):
    with pytest.raises(UserError, match="unknown evaluation data"):
        load_eval_set("nonsense")
    other = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "q", "completion": "a"}])
    with pytest.raises(UserError, match="not a GSM8K .* HumanEval .* recorded-answers"):
        load_eval_set(other)
    broken = write_jsonl(
        tmp_path / "he.jsonl", [{"task_id": "T/0", "prompt": "def f():\n", "test": 3, "entry_point": "f"}]
    )
    with pytest.raises(UserError, match=r"he\.jsonl:1: .*'test'"):
        load_eval_set(f"humaneval:{broken}")


def test_recorded_answers_eval_set(tmp_path):
    """A distill output as an evaluation set: the prompt is the conversation before the answer, a
    response is right when it is the recorded answer, cut answers are skipped."""
    chat = [{"role": "user", "content": "What is 2 plus 2?"}]
    records = [
        {"id": "a", "source": "instructions", "messages": chat + [{"role": "assistant", "content": "4."}]},
        {"id": "b", "source": "toy", "messages": chat + [{"role": "assistant", "content": "cut"}], "finished": False},
        {"id": "c", "messages": chat + [{"role": "assistant", "content": " Four. "}], "finished": True},
    ]
    path = write_jsonl(tmp_path / "heldout.jsonl", records)
    eval_set = load_eval_set(path)
    examples = {ex.id: ex for ex in eval_set.examples}
    assert [(i, ex.family) for i, ex in sorted(examples.items())] == [("a", "instructions"), ("c", "answers")]
    assert examples["a"].messages == chat
    a_then_c = [examples["a"], examples["c"]]
    assert eval_set.score_many(a_then_c, ["4.", "Four."]) == [True, True]
    assert eval_set.score_many(a_then_c, ["4", "Four. And more."]) == [False, False]
    # a subset is the same whatever order the file holds the records in (a batched distill writes
    # short answers first)
    backwards = write_jsonl(tmp_path / "backwards.jsonl", records[::-1])
    first = [ex.id for ex in load_eval_set(f"answers:{path}", n=1).examples]
    assert first == [ex.id for ex in load_eval_set(f"answers:{backwards}", n=1).examples]
    assert first == [eval_set.examples[0].id]
    no_answer = write_jsonl(tmp_path / "open.jsonl", [{"messages": chat}])
    with pytest.raises(UserError, match="open.jsonl:1: .*assistant"):
        load_eval_set(no_answer)
