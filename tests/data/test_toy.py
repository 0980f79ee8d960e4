"""The embedded task suite: deterministic, balanced, disjoint splits and strict scorers."""

from __future__ import annotations

import collections
import json
import re
import time
from dataclasses import replace

import pytest

from marslm.data import toy


def _prompt(example: toy.Example) -> str:
    return example.messages[-1]["content"]


def _by_family(n: int, split: str = "train", seed: int = 0) -> dict[str, list[toy.Example]]:
    groups = collections.defaultdict(list)
    for example in toy.make_split(split, n, seed=seed):
        groups[example.family].append(example)
    return groups


# --- Splits -------------------------------------------------------------------


def test_same_arguments_give_identical_examples():
    assert toy.make_split("train", 200, seed=3) == toy.make_split("train", 200, seed=3)
    assert toy.make_split("test", 50) == toy.make_split("test", 50)


def test_different_seed_gives_different_examples():
    a, b = toy.make_split("train", 100, seed=0), toy.make_split("train", 100, seed=1)
    assert [_prompt(x) for x in a] != [_prompt(x) for x in b]


def test_smaller_n_is_a_prefix_of_larger_n():
    assert toy.make_split("train", 37) == toy.make_split("train", 100)[:37]


def test_families_are_balanced_round_robin():
    examples = toy.make_split("train", 103)
    assert [ex.family for ex in examples[:8]] == list(toy.FAMILIES) * 2
    counts = collections.Counter(ex.family for ex in examples)
    assert set(counts) == set(toy.FAMILIES)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_family_subset():
    examples = toy.make_split("test", 10, families=["lists", "code"])
    assert [ex.family for ex in examples] == ["lists", "code"] * 5


def test_weighted_mixture_is_an_even_interleave_with_the_asked_shares():
    examples = toy.make_split("train", 100, weights={"lists": 2})
    counts = collections.Counter(ex.family for ex in examples)
    assert counts == {"lists": 40, "arithmetic": 20, "format": 20, "code": 20}
    first_ten = collections.Counter(ex.family for ex in examples[:10])
    assert first_ten == {"lists": 4, "arithmetic": 2, "format": 2, "code": 2}  # any prefix, same mixture
    # A family's items are its own stream: the mixture changes how many, not which.
    lists = [ex for ex in examples if ex.family == "lists"]
    assert lists == toy.make_split("train", 40, families=["lists"])


def test_equal_weights_are_the_balanced_default():
    assert toy.make_split("train", 50, weights={"code": 3, "lists": 3, "format": 3, "arithmetic": 3}) == toy.make_split(
        "train", 50
    )


@pytest.mark.parametrize("weights", [{"poetry": 2}, {"lists": 0}, {"lists": -1}, {"lists": float("nan")}])
def test_bad_weights_raise_value_error(weights):
    with pytest.raises(ValueError, match="mixture weights"):
        toy.make_split("train", 4, weights=weights)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"split": "validation"},
        {"split": "train", "families": ["poetry"]},
        {"split": "train", "families": []},
        {"split": "train", "n": -1},
    ],
)
def test_bad_arguments_raise_value_error(kwargs):
    kwargs = {"n": 4, **kwargs}
    with pytest.raises(ValueError):
        toy.make_split(**kwargs)


def test_train_and_test_prompts_are_disjoint():
    train = {_prompt(ex) for seed in (0, 1) for ex in toy.make_split("train", 3000, seed=seed)}
    test = {_prompt(ex) for seed in (0, 1) for ex in toy.make_split("test", 1000, seed=seed)}
    assert len(test) > 1500  # a real sample, not a handful of repeats
    assert not train & test


def test_the_split_is_decided_by_content_not_wording():
    # Rewording must not move an instance across splits: all test arithmetic stories are test content.
    for ex in toy.make_split("test", 200, families=["arithmetic"]):
        story = re.sub(r"^(Solve step by step\. |Question: |Word problem: )", "", _prompt(ex))
        assert toy.split_of("arithmetic", {"story": story}) == "test"


def test_ids_and_prompts_are_unique_within_a_split():
    examples = toy.make_split("train", 4000)
    assert len({ex.id for ex in examples}) == len(examples)
    assert len({_prompt(ex) for ex in examples}) == len(examples)
    assert all(ex.id.startswith(ex.family + "-") for ex in examples)


def test_each_family_uses_several_phrasings():
    for family, examples in _by_family(800).items():
        openings = {" ".join(_prompt(ex).split()[:2]) for ex in examples}
        assert len(openings) >= 3, family


def test_prompts_and_answers_stay_short():
    for ex in toy.make_split("train", 2000):
        assert 0 < len(_prompt(ex)) <= 200 and 0 < len(ex.answer) <= 220, ex


def test_meta_and_chat_record_are_json_serialisable():
    for ex in toy.make_split("train", 40):
        record = toy.to_chat_record(ex)
        assert json.loads(json.dumps(record)) == record
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert record["messages"][0] == ex.messages[0]
        assert record["messages"][-1]["content"] == ex.answer
        # A JSON round trip of meta (as when examples are saved) keeps the scorer working.
        reloaded = replace(ex, meta=json.loads(json.dumps(ex.meta)))
        assert toy.score(reloaded, ex.answer)


def test_chat_record_does_not_alias_the_example():
    ex = toy.make_split("train", 1)[0]
    toy.to_chat_record(ex)["messages"][0]["content"] = "changed"
    assert _prompt(ex) != "changed"


# --- Scorers accept reference answers ---------------------------------------------


def test_reference_answers_are_accepted():
    examples = toy.make_split("train", 800) + toy.make_split("test", 200)  # 250 per family
    verdicts = toy.score_many(examples, [ex.answer for ex in examples])
    assert [ex.id for ex, ok in zip(examples, verdicts) if not ok] == []


def test_score_agrees_with_score_many():
    examples = toy.make_split("test", 8)
    responses = [ex.answer for ex in examples[:4]] + ["nonsense"] * 4
    assert toy.score_many(examples, responses) == [toy.score(ex, r) for ex, r in zip(examples, responses)]
    assert toy.score_many(examples, responses) == [True] * 4 + [False] * 4


def test_score_many_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        toy.score_many(toy.make_split("test", 2), ["x"])


# --- Scorers reject near misses ---------------------------------------------------


def _first(family: str, predicate=lambda ex: True, n: int = 400) -> toy.Example:
    return next(ex for ex in toy.make_split("train", n, families=[family]) if predicate(ex))


def test_arithmetic_scores_the_final_number_only():
    for ex in toy.make_split("train", 50, families=["arithmetic"]):
        result = ex.meta["result"]
        steps = ex.answer.rsplit("\n", 1)[0]
        assert toy.score(ex, f"{steps}\nThe answer is {result}.")
        assert toy.score(ex, f"the answer is {result}")
        assert not toy.score(ex, f"{steps}\nThe answer is {result + 1}.")
        assert not toy.score(ex, f"{steps}\nThe answer is {result - 1}.")
        assert not toy.score(ex, f"{steps}\n{result}")  # no answer phrase
        assert not toy.score(ex, f"The answer is {result}. No wait, the answer is {result + 2}.")


def test_json_near_misses_are_rejected():
    ex = _first("format", lambda e: e.meta["kind"] == "json")
    fields = ex.meta["fields"]
    first = next(iter(fields))
    assert toy.score(ex, json.dumps(fields, indent=2))
    assert toy.score(ex, "```json\n" + json.dumps(fields) + "\n```")
    missing = {k: v for k, v in fields.items() if k != first}
    extra = {**fields, "note": "hi"}
    wrong = {**fields, first: fields[first] + 1 if isinstance(fields[first], int) else fields[first] + "x"}
    as_text = {k: str(v) for k, v in fields.items()}
    for bad in (missing, extra, wrong):
        assert not toy.score(ex, json.dumps(bad))
    if as_text != fields:  # "31" is not 31
        assert not toy.score(ex, json.dumps(as_text))
    assert not toy.score(ex, json.dumps(fields)[:-1])  # truncated
    assert not toy.score(ex, json.dumps(list(fields.values())))
    # what json.loads fails on outside JSONDecodeError is a wrong answer too, not a crash of the eval
    assert not toy.score(ex, "[" * 100_000)
    assert not toy.score(ex, json.dumps({**fields, first: 0}).replace(": 0", ": " + "7" * 5000))


def test_json_int_field_must_not_be_a_string():
    ex = _first("format", lambda e: e.meta["kind"] == "json" and "age" in e.meta["fields"])
    assert not toy.score(ex, json.dumps({**ex.meta["fields"], "age": str(ex.meta["fields"]["age"])}))


def test_bullet_near_misses_are_rejected():
    ex = _first("format", lambda e: e.meta["kind"] == "bullets" and len(e.meta["words"]) == 3)
    lines = ex.answer.splitlines()
    topic = ex.meta["topic"].capitalize()
    assert toy.score(ex, "\n" + "\n\n".join(lines) + "\n")  # blank lines are not bullets
    assert not toy.score(ex, "\n".join(lines + [f"- {topic} are nice."]))  # one too many
    assert not toy.score(ex, "\n".join(lines[:-1]))  # one too few
    assert not toy.score(ex, "\n".join([lines[0][2:]] + lines[1:]))  # missing "- "
    assert not toy.score(ex, "\n".join([lines[1], lines[0], lines[2]]))  # words out of order
    assert not toy.score(ex, "\n".join(["- Things are " + ex.meta["words"][0] + "."] + lines[1:]))  # no topic


def test_uppercase_near_misses_are_rejected():
    ex = _first("format", lambda e: e.meta["kind"] == "uppercase")
    text = ex.meta["text"]
    assert toy.score(ex, "  " + text.upper() + "\n")
    assert not toy.score(ex, text)
    assert not toy.score(ex, text.capitalize())
    assert not toy.score(ex, " ".join(text.upper().split()[:-1]))


def test_list_near_misses_are_rejected():
    ex = _first("lists", lambda e: isinstance(e.meta["expected"], list) and len(set(e.meta["expected"])) >= 3)
    items = [str(x) for x in ex.meta["expected"]]
    swapped = [items[1], items[0], *items[2:]]
    assert toy.score(ex, "  " + ex.answer + "\n")
    assert toy.score(ex, "[" + ",".join(items) + "]")
    assert not toy.score(ex, "[" + ", ".join(swapped) + "]")
    assert not toy.score(ex, "[" + ", ".join(items[:-1]) + "]")
    assert not toy.score(ex, "[" + ", ".join(items + items[-1:]) + "]")
    assert not toy.score(ex, ", ".join(items))  # brackets are part of the format


def test_list_scalar_near_misses_are_rejected():
    ex = _first("lists", lambda e: e.meta["op"] == "maximum")
    assert toy.score(ex, f" {ex.meta['expected']}\n")
    assert not toy.score(ex, str(ex.meta["expected"] - 1))
    assert not toy.score(ex, f"[{ex.meta['expected']}]")


def _failing_one_test(ex: toy.Example) -> str:
    """The reference solution, except that it answers the first hidden test wrongly."""
    name = ex.meta["entry_point"]
    first_args = ex.meta["tests"][0][0]
    reference = ex.answer.replace(f"def {name}(", "def _reference(", 1)
    return (
        f"{reference}\n\ndef {name}(*args):\n"
        f"    if list(args) == {first_args!r}:\n        return None\n    return _reference(*args)\n"
    )


def test_code_that_fails_one_hidden_test_is_rejected():
    examples = toy.make_split("train", 60, families=["code"])
    kinds = {ex.meta["kind"] for ex in examples}
    assert len(kinds) >= 8
    near_misses = [_failing_one_test(ex) for ex in examples]
    assert toy.score_many(examples, [ex.answer for ex in examples]) == [True] * len(examples)
    assert toy.score_many(examples, near_misses) == [False] * len(examples)


def test_code_in_a_fence_is_extracted():
    ex = _first("code")
    assert toy.score(ex, f"Sure:\n```python\n{ex.answer}\n```\nThis works.")
    assert not toy.score(ex, f"Sure:\n{ex.answer}\nThis works.")  # prose is not Python


# --- Malicious or broken code -----------------------------------------------------


@pytest.fixture(scope="module")
def add_example() -> toy.Example:
    return _first("code", lambda e: e.meta["kind"] == "add")


def _stub(ex: toy.Example, body: str) -> str:
    return f"def {ex.meta['entry_point']}(x):\n" + "\n".join("    " + line for line in body.splitlines())


def test_infinite_loop_is_killed_and_rejected(add_example):
    start = time.monotonic()
    assert not toy.score(add_example, _stub(add_example, "while True:\n    pass"))
    assert time.monotonic() - start < toy.CODE_TIMEOUT_S + 1


def test_wall_clock_timeout_is_respected(add_example):
    sleeper = "import time\ntime.sleep(60)\n" + add_example.answer
    start = time.monotonic()
    assert toy.score_many([add_example], [sleeper], timeout=1.0) == [False]
    assert time.monotonic() - start < 3


def test_file_writes_and_deletes_do_not_reach_the_machine(add_example, outside_dir):
    """The answers are otherwise right: the verdict is not the point, the files are."""
    keep = outside_dir / "keep.txt"
    keep.write_text("precious")
    keep.chmod(0o666)
    targets = [outside_dir / f"pwned{i}.txt" for i in range(3)]
    attacks = [
        f"open({str(targets[0])!r}, 'w').write('x')",
        f"import pathlib\npathlib.Path({str(targets[1])!r}).write_text('x')",
        f"import _io\n_io.open({str(targets[2])!r}, 'a').write('x')",
        f"import posix\nposix.unlink({str(keep)!r})",
        f"import os\nos.system('touch {outside_dir}/system')",
        f"import subprocess\nsubprocess.run(['touch', '{outside_dir}/subprocess'])",
    ]
    responses = [add_example.answer + "\n" + attack for attack in attacks]
    toy.score_many([add_example] * len(responses), responses)
    assert keep.read_text() == "precious"
    assert sorted(p.name for p in outside_dir.iterdir()) == ["keep.txt"]


def test_os_system_inside_the_function_does_not_reach_the_machine(add_example, outside_dir):
    marker = outside_dir / "called"
    k = add_example.meta["tests"][0][1]  # f(0) == k
    body = f"import os\nos.system('touch {marker}')\nreturn x + {k}"
    toy.score(add_example, _stub(add_example, body))
    assert not marker.exists()


def test_exiting_early_does_not_pass(add_example):
    for exit_call in (
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "raise SystemExit(0)",
        "import sys\nsys.modules['__main__']._exit(0)",
        "import posix\nposix._exit(0)",
    ):
        assert not toy.score(add_example, _stub(add_example, "return 0") + "\n" + exit_call)


def test_forged_equality_does_not_pass(add_example):
    forged = "class Anything:\n    def __eq__(self, other):\n        return True\n\n"
    assert not toy.score(add_example, forged + _stub(add_example, "return Anything()"))
    sneaky_int = "class Anything(int):\n    def __eq__(self, other):\n        return True\n\n"
    assert not toy.score(add_example, sneaky_int + _stub(add_example, "return Anything(0)"))


def test_broken_code_is_rejected(add_example):
    for response in ("", "def", "return 3", "import nonexistent_module", "x = [0] * (10 ** 10)"):
        assert not toy.score(add_example, response)
