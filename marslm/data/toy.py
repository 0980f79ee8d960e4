"""The embedded default task suite: procedurally generated instructions, scored automatically.

No model hub is reachable, so marslm carries its own data: four families of
chat instructions, generated from a seed, each with a reference answer and an
automatic scorer. A model of a few million parameters is trained on it from scratch
on a CPU in minutes, and then the multi-token decoder must match that model's
accuracy while taking fewer forward passes.

Design
------
* **Families of different predictability.** The speed-up of multi-token
  decoding comes from spans the model can guess several tokens ahead, so the
  families deliberately differ in how much of the answer is boilerplate:

  - ``format``     (IFEval-like): JSON records, bullet lists, uppercase
    rewrites. Almost all of the answer is copied from the prompt or fixed text.
  - ``code``       (HumanEval-like): tiny Python functions. ``def``, the
    signature, a docstring restating the spec and loop idioms are
    predictable; the operator and constant are not.
  - ``arithmetic`` (GSM8K-like): two-step word problems with a worked solution
    in a fixed format ending in "The answer is N.". Phrases are predictable,
    the computed numbers are not.
  - ``lists``      : sort / reverse / dedupe / filter / max of short lists. The
    answer is a bare list: little boilerplate, every item is "content".

* **Small numbers, short texts.** Operands are single digits (results < 100),
  lists have 4-7 items, answers are a few lines. A tiny CPU-trained model has
  to be genuinely competent on the suite, otherwise "the fast decoder matches
  the base model's accuracy" compares two near-zero scores and measures
  nothing; multi-digit, multi-step arithmetic is out of a tiny model's reach in
  minutes of CPU time, single-digit two-step problems are not.

* **Disjoint splits.** Every generated instance has a phrasing-independent
  *content* (the story, the list and operation, the function spec, ...). The
  split an instance belongs to is a function of a hash of that content
  (``hash % 10 == 0`` -> test), and generation for a split simply redraws
  instances that belong to the other one. So no test instance can appear in
  train for any ``n`` or seed, not even reworded: every phrasing of the same
  content lands in the same split. Each phrasing renders all of the content,
  so equal prompts imply equal content. Within a split, generation prefers
  unseen content, then an unseen wording; a prompt repeats only once a
  family's pool for that split is used up (far beyond the sizes we use).
  The price: at large n the families' sub-kinds with small pools (e.g.
  ``max_of_two`` in ``code``) become rarer than the big ones.

* **Strict scorers.** Each family is scored by checking what the instruction
  asked for (the final number; the JSON fields and values; the bullet count
  and words; the exact list; hidden unit tests), not by string equality with
  the reference, and near misses fail. Code runs in marslm's sandbox
  (``marslm.data.sandbox``: an operating-system sandbox with no network, a
  read-only file system and resource limits); the expected values stay
  outside it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .sandbox import run_many_to_end

FAMILIES: tuple[str, ...] = ("arithmetic", "format", "lists", "code")
SPLITS: tuple[str, ...] = ("train", "test")

# One instance in TEST_BUCKETS (by content hash) belongs to the test split.
TEST_BUCKETS = 10
# Dedupe budget: in-split draws spent looking for unseen content before a new
# wording of seen content will do, and total draws before even a repeat will.
FRESH_CONTENT_TRIES = 10
MAX_DRAWS_PER_EXAMPLE = 1000

CODE_TIMEOUT_S = 5.0  # wall clock, per program: also catches sleeping code (CPU: sandbox.Limits)


@dataclass(frozen=True)
class Example:
    """One instruction of the suite: a prompt, its reference answer, and what the scorer needs."""

    id: str  # "<family>-<hash of prompt and answer>", stable across runs
    family: str
    messages: list[dict]  # the chat without the assistant answer
    answer: str  # the reference assistant response
    meta: dict  # JSON-serialisable facts for the scorer


@dataclass(frozen=True)
class _Draw:
    """A freshly generated instance, before it is assigned an id."""

    content: dict  # phrasing-independent core: decides the split
    prompt: str
    answer: str
    meta: dict


# ---------------------------------------------------------------------------
# Shared vocabulary
# ---------------------------------------------------------------------------

_PEOPLE = {  # name -> subject pronoun
    "Tom": "he",
    "Ana": "she",
    "Sam": "he",
    "Mia": "she",
    "Leo": "he",
    "Zoe": "she",
    "Ben": "he",
    "Eva": "she",
    "Max": "he",
    "Ivy": "she",
    "Raj": "he",
    "Lin": "she",
    "Omar": "he",
    "Nina": "she",
    "Paul": "he",
    "Rosa": "she",
}
_NAMES = tuple(_PEOPLE)
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "eggs", "coins")
_CITIES = ("Oslo", "Paris", "Lima", "Cairo", "Tokyo", "Rome", "Delhi", "Quito", "Dakar", "Seoul", "Bern", "Riga")
_COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
_PETS = ("cat", "dog", "fish", "bird", "rabbit", "turtle", "horse", "hamster")
_JOBS = ("baker", "doctor", "pilot", "teacher", "farmer", "painter", "nurse", "chef")
_SHORT_WORDS = (
    "cat",
    "dog",
    "sun",
    "map",
    "pen",
    "cup",
    "box",
    "hat",
    "key",
    "egg",
    "bus",
    "fox",
    "owl",
    "jar",
    "kite",
    "lamp",
    "milk",
    "rose",
    "ship",
    "tree",
    "wolf",
    "bell",
    "coin",
    "drum",
)
_NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
)


def _render_list(items: Sequence) -> str:
    """The one list format used in prompts and answers: ``[3, 1, 2]`` or ``[cat, dog]``."""
    return "[" + ", ".join(str(item) for item in items) + "]"


# ---------------------------------------------------------------------------
# Family: arithmetic (GSM8K-like two-step word problems)
# ---------------------------------------------------------------------------
# Each story returns (story text, worked steps, result). Factors are 2..5 and
# every other operand one digit, so each step is a small fact: a from-scratch
# model of a few million parameters must learn them in minutes on a CPU.

_ARITHMETIC_PHRASINGS = (
    "{story}",
    "Solve step by step. {story}",
    "Question: {story}",
    "Word problem: {story}",
)

ANSWER_PHRASE = "The answer is"


def _story_groups_minus(rng: random.Random, name: str, pron: str, item: str):
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    total = a * b
    c = rng.randint(2, min(9, total - 1))
    result = total - c
    story = (
        f"{name} has {a} boxes with {b} {item} in each box. {pron.capitalize()} gives away {c} {item}. "
        f"How many {item} does {name} have left?"
    )
    steps = [
        f"{name} has {a} * {b} = {total} {item}.",
        f"{pron.capitalize()} gives away {c}, so {total} - {c} = {result}.",
    ]
    return story, steps, result


def _story_groups_plus(rng: random.Random, name: str, pron: str, item: str):
    a, b, c = rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 9)
    total = a * b
    result = total + c
    story = (
        f"{name} buys {a} bags with {b} {item} in each bag. Then {pron} finds {c} more {item}. "
        f"How many {item} does {name} have now?"
    )
    steps = [
        f"{name} buys {a} * {b} = {total} {item}.",
        f"{pron.capitalize()} finds {c} more, so {total} + {c} = {result}.",
    ]
    return story, steps, result


def _story_boxes_of_two_kinds(rng: random.Random, name: str, pron: str, item: str):
    a, b, boxes = rng.randint(1, 5), rng.randint(1, 5), rng.randint(2, 3)
    per_box = a + b
    result = boxes * per_box  # at most 3 * 10 = 30
    story = (
        f"{name} has {boxes} boxes. Each box holds {a} big {item} and {b} small {item}. "
        f"How many {item} does {name} have in all?"
    )
    steps = [
        f"Each box holds {a} + {b} = {per_box} {item}.",
        f"{boxes} boxes hold {boxes} * {per_box} = {result} {item}.",
    ]
    return story, steps, result


def _story_lose_then_buy(rng: random.Random, name: str, pron: str, item: str):
    a = rng.randint(5, 9)
    b = rng.randint(2, a - 1)
    c = rng.randint(2, 9)
    left = a - b
    result = left + c
    story = (
        f"{name} has {a} {item}. {pron.capitalize()} loses {b} of them and then buys {c} more. "
        f"How many {item} does {name} have now?"
    )
    steps = [
        f"After losing {b}, {name} has {a} - {b} = {left} {item}.",
        f"After buying {c} more, {name} has {left} + {c} = {result}.",
    ]
    return story, steps, result


def _story_share_then_more(rng: random.Random, name: str, pron: str, item: str):
    friends, each, extra = rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 9)
    total = friends * each
    result = each + extra
    story = (
        f"{name} shares {total} {item} equally among {friends} friends. Then each friend gets {extra} more. "
        f"How many {item} does each friend have?"
    )
    steps = [
        f"Each friend gets {total} / {friends} = {each} {item}.",
        f"With {extra} more, each friend has {each} + {extra} = {result}.",
    ]
    return story, steps, result


_STORIES = (
    _story_groups_minus,
    _story_groups_plus,
    _story_boxes_of_two_kinds,
    _story_lose_then_buy,
    _story_share_then_more,
)


def _draw_arithmetic(rng: random.Random) -> _Draw:
    name = rng.choice(_NAMES)
    story, steps, result = rng.choice(_STORIES)(rng, name, _PEOPLE[name], rng.choice(_ITEMS))
    answer = "\n".join([*steps, f"{ANSWER_PHRASE} {result}."])
    prompt = rng.choice(_ARITHMETIC_PHRASINGS).format(story=story)
    return _Draw({"story": story}, prompt, answer, {"kind": "word_problem", "result": result})


_FINAL_NUMBER = re.compile(re.escape(ANSWER_PHRASE) + r"\s*(-?\d+)", re.IGNORECASE)


def _score_arithmetic(example: Example, response: str) -> bool:
    """The number right after the last "The answer is" must equal the result."""
    matches = _FINAL_NUMBER.findall(response)
    return bool(matches) and int(matches[-1]) == example.meta["result"]


# ---------------------------------------------------------------------------
# Family: format (IFEval-like checkable constraints)
# ---------------------------------------------------------------------------

_JSON_FIELDS: dict[str, Callable[[random.Random], object]] = {
    "name": lambda rng: rng.choice(_NAMES),
    "age": lambda rng: rng.randint(18, 79),
    "city": lambda rng: rng.choice(_CITIES),
    "color": lambda rng: rng.choice(_COLORS),
    "pet": lambda rng: rng.choice(_PETS),
    "job": lambda rng: rng.choice(_JOBS),
    "score": lambda rng: rng.randint(1, 99),
}

_BULLET_TOPICS = (
    "cats",
    "dogs",
    "trees",
    "rivers",
    "books",
    "trains",
    "clouds",
    "birds",
    "songs",
    "boats",
    "flowers",
    "stars",
    "bridges",
    "gardens",
    "robots",
    "horses",
)
_BULLET_WORDS = (
    "quiet",
    "small",
    "old",
    "bright",
    "fast",
    "soft",
    "tall",
    "calm",
    "warm",
    "cold",
    "green",
    "happy",
    "loud",
    "rare",
    "strong",
    "gentle",
    "busy",
    "simple",
)
_BULLET_ENDINGS = ("are", "can be", "look", "seem")  # "- Cats are quiet." etc., by position

_SENTENCE_PARTS = (
    ("the", "a"),
    ("small", "brown", "quick", "lazy", "happy", "old", "young", "tiny"),
    ("dog", "cat", "fox", "bird", "horse", "frog", "mouse", "bear"),
    ("sleeps", "runs", "sits", "plays", "waits", "hides", "sings", "jumps"),
    ("near the river", "under the tree", "in the garden", "on the hill", "by the door", "at home"),
)


def _join_words(words: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _draw_json_record(rng: random.Random) -> _Draw:
    field_names = rng.sample(list(_JSON_FIELDS), rng.randint(2, 3))
    fields = {field: _JSON_FIELDS[field](rng) for field in field_names}
    phrasings = (
        "Make a JSON record with " + _join_words([f"{k} {v}" for k, v in fields.items()]) + ".",
        "Return a JSON object with these fields: " + ", ".join(f"{k} = {v}" for k, v in fields.items()) + ".",
        "Write only JSON. Fields: " + ", ".join(f"{k} is {v}" for k, v in fields.items()) + ".",
    )
    content = {"kind": "json", "fields": fields}
    return _Draw(content, rng.choice(phrasings), json.dumps(fields), content)


def _draw_bullets(rng: random.Random) -> _Draw:
    topic = rng.choice(_BULLET_TOPICS)
    words = rng.sample(_BULLET_WORDS, rng.randint(2, 4))
    n = len(words)
    listed = ", ".join(words)
    phrasings = (
        f"Write exactly {n} bullet lines about {topic}, one for each of these words in order: {listed}.",
        f'Give {n} bullet points starting with "- " about {topic}. Use these words, one per line, in order: {listed}.',
        f"Make a list of exactly {n} lines about {topic}, each starting with a dash. In order, use the words {listed}.",
    )
    answer = "\n".join(f"- {topic.capitalize()} {_BULLET_ENDINGS[i]} {word}." for i, word in enumerate(words))
    content = {"kind": "bullets", "topic": topic, "words": words}
    return _Draw(content, rng.choice(phrasings), answer, content)


def _draw_uppercase(rng: random.Random) -> _Draw:
    text = " ".join(rng.choice(part) for part in _SENTENCE_PARTS)
    phrasings = (
        f"Rewrite in uppercase: {text}",
        f"Convert this sentence to capital letters: {text}",
        f"Write the following in all caps: {text}",
    )
    content = {"kind": "uppercase", "text": text}
    return _Draw(content, rng.choice(phrasings), text.upper(), content)


_FORMAT_KINDS = (_draw_json_record, _draw_bullets, _draw_uppercase)


def _draw_format(rng: random.Random) -> _Draw:
    return rng.choice(_FORMAT_KINDS)(rng)


def _strip_fence(text: str) -> str:
    """The body of the first ``` fenced block, or the whole text when there is none."""
    match = re.search(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", text, re.DOTALL)
    return match.group(1) if match else text


def _same_value(got: object, want: object) -> bool:
    """Equal and of exactly the same type: 31 != "31" and True != 1 here."""
    return type(got) is type(want) and got == want


def _score_json(meta: dict, response: str) -> bool:
    try:
        record = json.loads(_strip_fence(response).strip())
    except (ValueError, RecursionError):  # also nesting past the recursion limit, integers past int()'s
        return False
    want = meta["fields"]
    return (
        isinstance(record, dict)
        and record.keys() == want.keys()
        and all(_same_value(record[key], value) for key, value in want.items())
    )


def _has_word(line: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", line, re.IGNORECASE) is not None


def _score_bullets(meta: dict, response: str) -> bool:
    """Exactly one "- " line per required word, in order, each also naming the topic."""
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    words = meta["words"]
    return len(lines) == len(words) and all(
        line.startswith("- ") and _has_word(line, meta["topic"]) and _has_word(line, word)
        for line, word in zip(lines, words)
    )


def _score_uppercase(meta: dict, response: str) -> bool:
    return response.split() == meta["text"].upper().split()


_FORMAT_SCORERS = {"json": _score_json, "bullets": _score_bullets, "uppercase": _score_uppercase}


def _score_format(example: Example, response: str) -> bool:
    return _FORMAT_SCORERS[example.meta["kind"]](example.meta, response)


# ---------------------------------------------------------------------------
# Family: lists (exact list and string manipulation)
# ---------------------------------------------------------------------------


def _numbers(rng: random.Random) -> list[int]:
    # One-digit numbers are one token each: sorting 3-5 of them is within a tiny model's reach.
    return [rng.randint(1, 9) for _ in range(rng.randint(3, 5))]


def _numbers_or_words(rng: random.Random) -> list:
    return _numbers(rng) if rng.random() < 0.5 else rng.sample(_SHORT_WORDS, rng.randint(3, 5))


def _with_repeats(rng: random.Random) -> list:
    """3-6 items of which at least one appears twice."""
    pool = list(range(1, 10)) if rng.random() < 0.5 else list(_SHORT_WORDS[:8])
    items = rng.sample(pool, rng.randint(2, 4))
    for _ in range(rng.randint(1, 2)):
        items.insert(rng.randint(1, len(items)), rng.choice(items))
    return items


def _with_some(parity: int) -> Callable[[random.Random], list[int]]:
    """Number lists with at least one item of the given parity, so a filter never answers []."""

    def draw(rng: random.Random) -> list[int]:
        while True:
            items = _numbers(rng)
            if any(x % 2 == parity for x in items):
                return items

    return draw


@dataclass(frozen=True)
class _ListOp:
    phrasings: tuple[str, ...]  # each with an {items} slot
    draw_items: Callable[[random.Random], list]
    apply: Callable[[list], object]  # a list, or a single item for max/min


_LIST_OPS: dict[str, _ListOp] = {
    "sort_ascending": _ListOp(
        (
            "Sort these numbers from smallest to largest: {items}",
            "Sort in ascending order: {items}",
            "Arrange these numbers from lowest to highest: {items}",
        ),
        _numbers,
        sorted,
    ),
    "sort_descending": _ListOp(
        (
            "Sort these numbers from largest to smallest: {items}",
            "Sort in descending order: {items}",
            "Arrange these numbers from highest to lowest: {items}",
        ),
        _numbers,
        lambda items: sorted(items, reverse=True),
    ),
    "sort_words": _ListOp(
        (
            "Sort these words alphabetically: {items}",
            "Put these words in alphabetical order: {items}",
            "Arrange these words from A to Z: {items}",
        ),
        lambda rng: rng.sample(_SHORT_WORDS, rng.randint(3, 5)),
        sorted,
    ),
    "reverse": _ListOp(
        (
            "Reverse this list: {items}",
            "Write this list in reverse order: {items}",
            "Give the items of this list backwards: {items}",
        ),
        _numbers_or_words,
        lambda items: items[::-1],
    ),
    "dedupe": _ListOp(
        (
            "Remove duplicates from this list, keeping the first occurrence: {items}",
            "Drop the repeated items, keeping first occurrences in order: {items}",
            "List each item once, in order of first appearance: {items}",
        ),
        _with_repeats,
        lambda items: list(dict.fromkeys(items)),
    ),
    "keep_even": _ListOp(
        (
            "Keep only the even numbers: {items}",
            "Filter this list to its even numbers: {items}",
            "Remove the odd numbers from this list: {items}",
        ),
        _with_some(0),
        lambda items: [x for x in items if x % 2 == 0],
    ),
    "keep_odd": _ListOp(
        (
            "Keep only the odd numbers: {items}",
            "Filter this list to its odd numbers: {items}",
            "Remove the even numbers from this list: {items}",
        ),
        _with_some(1),
        lambda items: [x for x in items if x % 2 == 1],
    ),
    "maximum": _ListOp(
        (
            "What is the largest number in {items}?",
            "Find the maximum of {items}.",
            "Give the biggest value in this list: {items}",
        ),
        _numbers,
        max,
    ),
    "minimum": _ListOp(
        (
            "What is the smallest number in {items}?",
            "Find the minimum of {items}.",
            "Give the lowest value in this list: {items}",
        ),
        _numbers,
        min,
    ),
}


def _draw_lists(rng: random.Random) -> _Draw:
    op_name = rng.choice(list(_LIST_OPS))
    op = _LIST_OPS[op_name]
    items = op.draw_items(rng)
    result = op.apply(items)
    answer = _render_list(result) if isinstance(result, list) else str(result)
    prompt = rng.choice(op.phrasings).format(items=_render_list(items))
    return _Draw({"op": op_name, "items": items}, prompt, answer, {"op": op_name, "expected": result})


def _parse_list(text: str) -> list[str] | None:
    """``"[3, 1, 2]"`` -> ``["3", "1", "2"]``; None when the text is not one bracketed list."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    inner = text[1:-1].strip()
    return [part.strip() for part in inner.split(",")] if inner else []


def _score_lists(example: Example, response: str) -> bool:
    expected = example.meta["expected"]
    if isinstance(expected, list):
        return _parse_list(response) == [str(item) for item in expected]
    return response.strip() == str(expected)


# ---------------------------------------------------------------------------
# Family: code (HumanEval-like tiny functions with hidden tests)
# ---------------------------------------------------------------------------

_NUMBER_PARAMS = ("x", "n", "value", "num", "number")
_PAIR_PARAMS = (
    ("a", "b"),
    ("x", "y"),
    ("m", "n"),
    ("first", "second"),
    ("left", "right"),
    ("p", "q"),
    ("u", "v"),
    ("i", "j"),
)
_STRING_PARAMS = ("s", "text", "word", "string", "phrase")
_LIST_PARAMS = ("nums", "values", "numbers", "items", "data", "xs", "scores")

_CODE_PHRASINGS = (
    "Write a Python function {signature} that {description}.",
    "Implement {signature} in Python. The function {description}.",
    "Define a Python function {signature} which {description}.",
    "Python task: write {signature}, a function that {description}.",
)


@dataclass(frozen=True)
class _Function:
    """A function spec: what the prompt describes, the reference body, and the hidden tests."""

    name: str
    params: tuple[str, ...]
    description: str  # "returns x plus 3", completing "a function that ..."
    body: tuple[str, ...]  # lines, relative to the function's indentation
    tests: list[list]  # [[args, expected], ...]

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(self.params)})"

    @property
    def source(self) -> str:
        # The docstring restates the spec: predictable text, as in real code.
        docstring = f'    """{self.description[0].upper()}{self.description[1:]}."""'
        return "\n".join([f"def {self.signature}:", docstring, *("    " + line for line in self.body)])


def _fn_add(rng: random.Random) -> _Function:
    k, x = rng.randint(1, 20), rng.choice(_NUMBER_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"add_{w}", f"plus_{w}", f"increase_by_{w}"))
    return _Function(
        name, (x,), f"returns {x} plus {k}", (f"return {x} + {k}",), [[[v], v + k] for v in (0, 1, 7, -3, 25)]
    )


def _fn_subtract(rng: random.Random) -> _Function:
    k, x = rng.randint(1, 20), rng.choice(_NUMBER_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"subtract_{w}", f"minus_{w}", f"decrease_by_{w}"))
    return _Function(
        name, (x,), f"returns {x} minus {k}", (f"return {x} - {k}",), [[[v], v - k] for v in (0, 1, 9, -4, 30)]
    )


def _fn_multiply(rng: random.Random) -> _Function:
    k, x = rng.randint(2, 12), rng.choice(_NUMBER_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"times_{w}", f"multiply_by_{w}", f"scale_by_{w}"))
    return _Function(
        name, (x,), f"returns {x} times {k}", (f"return {x} * {k}",), [[[v], v * k] for v in (0, 1, 3, -2, 10)]
    )


def _fn_affine(rng: random.Random) -> _Function:
    a, b, x = rng.randint(2, 9), rng.randint(1, 9), rng.choice(_NUMBER_PARAMS)
    name = rng.choice(("affine", "linear", "transform", "compute"))
    return _Function(
        name,
        (x,),
        f"returns {x} times {a} plus {b}",
        (f"return {x} * {a} + {b}",),
        [[[v], v * a + b] for v in (0, 1, 4, -3)],
    )


def _fn_divisible(rng: random.Random) -> _Function:
    k, x = rng.randint(2, 9), rng.choice(_NUMBER_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"is_multiple_of_{w}", f"divisible_by_{w}", f"is_divisible_by_{w}"))
    return _Function(
        name,
        (x,),
        f"returns True if {x} is divisible by {k}, otherwise False",
        (f"return {x} % {k} == 0",),
        [[[v], v % k == 0] for v in (0, k, k + 1, 2 * k, 3 * k - 1, 7)],
    )


def _fn_in_range(rng: random.Random) -> _Function:
    lo = rng.randint(0, 10)
    hi = lo + rng.randint(2, 12)
    x = rng.choice(_NUMBER_PARAMS)
    name = rng.choice(("in_range", "is_between", "within_bounds"))
    return _Function(
        name,
        (x,),
        f"returns True if {x} is between {lo} and {hi} inclusive, otherwise False",
        (f"return {lo} <= {x} <= {hi}",),
        [[[v], lo <= v <= hi] for v in (lo - 1, lo, (lo + hi) // 2, hi, hi + 1)],
    )


def _fn_pick_of_two(larger: bool) -> Callable[[random.Random], _Function]:
    """The larger (or smaller) of two arguments, spelled out with an if."""
    word, op, pick = ("larger", ">", max) if larger else ("smaller", "<", min)
    names = (
        ("larger", "max_of_two", "bigger", "pick_max", "maximum", "greater", "max2", "biggest")
        if larger
        else ("smaller", "min_of_two", "lesser", "pick_min", "minimum", "least", "min2", "smallest")
    )

    def draw(rng: random.Random) -> _Function:
        p, q = rng.choice(_PAIR_PARAMS)
        return _Function(
            rng.choice(names),
            (p, q),
            f"returns the {word} of {p} and {q}",
            (f"if {p} {op} {q}:", f"    return {p}", f"return {q}"),
            [[[u, v], pick(u, v)] for u, v in ((3, 5), (9, 2), (-1, -4), (6, 6), (0, -7))],
        )

    return draw


def _fn_repeat(rng: random.Random) -> _Function:
    k, s = rng.randint(2, 9), rng.choice(_STRING_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"repeat_{w}", f"repeat_{w}_times", f"echo_{w}"))
    return _Function(
        name,
        (s,),
        f"returns the string {s} repeated {k} times",
        (f"return {s} * {k}",),
        [[[v], v * k] for v in ("ab", "x", "", "hi!")],
    )


def _fn_prefix(rng: random.Random) -> _Function:
    k, s = rng.randint(1, 9), rng.choice(_STRING_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"first_{w}", f"prefix_{w}", f"head_{w}"))
    return _Function(
        name,
        (s,),
        f"returns the first {k} characters of the string {s}",
        (f"return {s}[:{k}]",),
        [[[v], v[:k]] for v in ("python", "ab", "", "hello world")],
    )


def _fn_list_sum(rng: random.Random) -> _Function:
    xs = rng.choice(_LIST_PARAMS)
    name = rng.choice(
        ("sum_list", "sum_numbers", "add_all", "list_total", "sum_of", "add_up", "sum_all", "grand_total")
    )
    return _Function(
        name,
        (xs,),
        f"returns the sum of the numbers in the list {xs}",
        ("total = 0", f"for v in {xs}:", "    total += v", "return total"),
        [[[v], sum(v)] for v in ([], [1, 2, 3], [-4, 10], [7], [5, 5, 5, 5])],
    )


def _fn_count_greater(rng: random.Random) -> _Function:
    k, xs = rng.randint(0, 10), rng.choice(_LIST_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"count_above_{w}", f"count_greater_than_{w}", f"how_many_over_{w}"))
    cases = ([], [k], [k + 1, k - 1, k + 5], [k + 2, k + 3, k, k + 1], [k - 3, k - 2])
    return _Function(
        name,
        (xs,),
        f"returns how many numbers in the list {xs} are greater than {k}",
        ("count = 0", f"for v in {xs}:", f"    if v > {k}:", "        count += 1", "return count"),
        [[[case], sum(v > k for v in case)] for case in cases],
    )


def _fn_scale_list(rng: random.Random) -> _Function:
    k, xs = rng.randint(2, 9), rng.choice(_LIST_PARAMS)
    w = _NUMBER_WORDS[k]
    name = rng.choice((f"multiply_all_by_{w}", f"scale_list_by_{w}", f"times_{w}_each"))
    return _Function(
        name,
        (xs,),
        f"returns a new list with every number in {xs} multiplied by {k}",
        (f"return [v * {k} for v in {xs}]",),
        [[[v], [item * k for item in v]] for v in ([], [1, 2, 3], [-2, 0], [10])],
    )


_FUNCTION_KINDS: dict[str, Callable[[random.Random], _Function]] = {
    "add": _fn_add,
    "subtract": _fn_subtract,
    "multiply": _fn_multiply,
    "affine": _fn_affine,
    "divisible": _fn_divisible,
    "in_range": _fn_in_range,
    "max_of_two": _fn_pick_of_two(larger=True),
    "min_of_two": _fn_pick_of_two(larger=False),
    "repeat": _fn_repeat,
    "prefix": _fn_prefix,
    "list_sum": _fn_list_sum,
    "count_greater": _fn_count_greater,
    "scale_list": _fn_scale_list,
}


def _draw_code(rng: random.Random) -> _Draw:
    kind = rng.choice(list(_FUNCTION_KINDS))
    fn = _FUNCTION_KINDS[kind](rng)
    prompt = rng.choice(_CODE_PHRASINGS).format(signature=fn.signature, description=fn.description)
    content = {"kind": kind, "signature": fn.signature, "description": fn.description}
    return _Draw(content, prompt, fn.source, {"kind": kind, "entry_point": fn.name, "tests": fn.tests})


# --- Running answers against hidden tests -----------------------------------
#
# The answer runs in marslm's sandbox (marslm/data/sandbox.py: bubblewrap, rlimits, a timeout), with a
# driver that calls the function on each test's arguments and prints the results, each with its
# exact type spelled out. The expected values never enter the sandbox: the comparison happens
# here, on printed values, so neither an object with a forged __eq__ nor an early exit can pass.


def _typed(value):
    """``value`` with its exact type at every level (runs in the sandbox too, as source)."""
    kind = type(value)
    if kind is list or kind is tuple:
        return [kind.__name__, [_typed(item) for item in value]]
    if value is None or kind is int or kind is bool or kind is str or kind is float:
        return [kind.__name__, value]
    return [kind.__name__, None]  # anything else matches no expected value


_DRIVER = """
import json as _json
{typed}
_namespace = {{"__name__": "solution"}}
exec(compile({code!r}, "<answer>", "exec"), _namespace)
_function = _namespace[{entry_point!r}]
_results = [_typed(_function(*_args)) for _args in {arguments!r}]
print()
print(_json.dumps(_results))
"""


def extract_code(response: str) -> str:
    """The code in a response: the first ``` fenced block if any, else the whole text."""
    return _strip_fence(response)


def _driver_program(code: str, entry_point: str, tests: list) -> str:
    return _DRIVER.format(
        typed=inspect.getsource(_typed), code=code, entry_point=entry_point, arguments=[args for args, _ in tests]
    )


def _passed(output: str | None, tests: list) -> bool:
    if output is None:  # it raised, exited early or ran out of time
        return False
    try:
        results = json.loads(output.rpartition("\n")[2])
    except ValueError:
        return False
    return results == json.loads(json.dumps([_typed(want) for _, want in tests]))


def _score_code_batch(examples: Sequence[Example], responses: Sequence[str], timeout: float) -> list[bool]:
    """Hidden-test verdicts for many code answers, a few sandboxed programs at a time."""
    programs = [
        _driver_program(extract_code(response), ex.meta["entry_point"], ex.meta["tests"])
        for ex, response in zip(examples, responses)
    ]
    outputs = run_many_to_end(programs, timeout)
    return [_passed(output, ex.meta["tests"]) for ex, output in zip(examples, outputs)]


# ---------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------

_DRAWERS: dict[str, Callable[[random.Random], _Draw]] = {
    "arithmetic": _draw_arithmetic,
    "format": _draw_format,
    "lists": _draw_lists,
    "code": _draw_code,
}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _content_key(family: str, content: dict) -> str:
    return json.dumps([family, content], sort_keys=True, separators=(",", ":"))


def split_of(family: str, content: dict) -> str:
    """The split an instance belongs to, decided by its phrasing-independent content alone."""
    digest = _sha256(_content_key(family, content))
    return "test" if int(digest[:16], 16) % TEST_BUCKETS == 0 else "train"


@dataclass
class _Seen:
    """What a split has already drawn, to avoid repeats."""

    contents: set[str]
    prompts: set[str]

    def novelty(self, family: str, draw: _Draw) -> int:
        """0: new content; 1: known content, new wording; 2: a repeated prompt."""
        if _content_key(family, draw.content) not in self.contents:
            return 0
        return 1 if draw.prompt not in self.prompts else 2

    def add(self, family: str, draw: _Draw) -> None:
        self.contents.add(_content_key(family, draw.content))
        self.prompts.add(draw.prompt)


def _draw_for_split(family: str, split: str, rng: random.Random, seen: _Seen) -> _Draw:
    """A draw belonging to `split`, as novel as can be found quickly.

    New content is preferred; after FRESH_CONTENT_TRIES in-split draws without
    any (a small pool, nearly used up), a new wording of known content will
    do; after MAX_DRAWS_PER_EXAMPLE draws, even a repeated prompt.
    """
    best, best_novelty, in_split = None, 3, 0
    for _ in range(MAX_DRAWS_PER_EXAMPLE):
        draw = _DRAWERS[family](rng)
        if split_of(family, draw.content) != split:
            continue  # belongs to the other split: never use it here
        in_split += 1
        novelty = seen.novelty(family, draw)
        if novelty < best_novelty:
            best, best_novelty = draw, novelty
        if best_novelty == 0 or (best_novelty == 1 and in_split >= FRESH_CONTENT_TRIES):
            break
    if best is None:
        raise RuntimeError(f"could not draw a {split} instance of {family!r}")
    return best


def _family_examples(family: str, split: str, count: int, seed: int) -> list[Example]:
    # One RNG stream per (split, seed, family): a family's examples do not depend on
    # which other families are requested, and a smaller n gives a prefix of a larger one.
    rng = random.Random(f"marslm-toy/{split}/{seed}/{family}")
    seen = _Seen(set(), set())
    used_ids: set[str] = set()
    examples = []
    for _ in range(count):
        draw = _draw_for_split(family, split, rng, seen)
        seen.add(family, draw)
        digest = _sha256(draw.prompt + chr(0) + draw.answer)[:12]
        example_id, repeat = f"{family}-{digest}", 1
        while example_id in used_ids:  # only once a pool is used up and a prompt repeats
            repeat += 1
            example_id = f"{family}-{digest}-{repeat}"
        used_ids.add(example_id)
        examples.append(Example(example_id, family, [{"role": "user", "content": draw.prompt}], draw.answer, draw.meta))
    return examples


def make_split(
    split: str, n: int, seed: int = 0, families: Sequence[str] | None = None, weights: Mapping[str, float] | None = None
) -> list[Example]:
    """`n` examples of `split` ("train" or "test"), interleaved over `families`; deterministic.

    By default example i has family ``families[i % len(families)]``, so the families are
    balanced to within one example. ``weights`` (family -> relative share, default 1) skews a
    training mixture towards the families that are slowest to learn; the order stays an even
    interleave (smooth weighted round robin), so any prefix has the same mixture. Train and test
    never share an instance.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    families = tuple(FAMILIES if families is None else families)
    if not families or len(set(families)) != len(families) or not set(families) <= set(FAMILIES):
        raise ValueError(f"families must be distinct names from {FAMILIES}, got {families!r}")
    share = check_weights(weights or {}, families)
    order = _interleave(families, share, n)
    per_family = {family: iter(_family_examples(family, split, order.count(family), seed)) for family in families}
    return [next(per_family[family]) for family in order]


def check_weights(weights: Mapping[str, float], families: Sequence[str] = FAMILIES) -> dict[str, float]:
    """Every family's share (1 unless given); refuses unknown families and non-positive weights."""
    unknown = set(weights) - set(families)
    if unknown:
        raise ValueError(f"mixture weights for unknown families {sorted(unknown)}; families are {tuple(families)}")
    bad = {name: w for name, w in weights.items() if not w > 0}
    if bad:
        raise ValueError(f"mixture weights must be positive, got {bad}")
    return {family: float(weights.get(family, 1.0)) for family in families}


def _interleave(families: Sequence[str], share: Mapping[str, float], n: int) -> list[str]:
    # Smooth weighted round robin: each turn every family earns its share and the richest one
    # (the first on a tie) is drawn and pays the total. Equal shares give plain round robin.
    total = sum(share.values())
    credit = dict.fromkeys(families, 0.0)
    order = []
    for _ in range(n):
        for family in families:
            credit[family] += share[family]
        pick = max(families, key=credit.__getitem__)
        credit[pick] -= total
        order.append(pick)
    return order


# ---------------------------------------------------------------------------
# Scoring and export
# ---------------------------------------------------------------------------

_IN_PROCESS_SCORERS: dict[str, Callable[[Example, str], bool]] = {
    "arithmetic": _score_arithmetic,
    "format": _score_format,
    "lists": _score_lists,
}


def score_many(examples: Sequence[Example], responses: Sequence[str], *, timeout: float = CODE_TIMEOUT_S) -> list[bool]:
    """Verdicts for many responses at once; code answers run concurrently in sandboxed children."""
    if len(examples) != len(responses):
        raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
    verdicts: list[bool] = [False] * len(examples)
    code_indices = []
    for i, (example, response) in enumerate(zip(examples, responses)):
        if not isinstance(response, str):
            continue  # no text, no credit
        if example.family == "code":
            code_indices.append(i)
        elif example.family in _IN_PROCESS_SCORERS:
            verdicts[i] = _IN_PROCESS_SCORERS[example.family](example, response)
        else:
            raise ValueError(f"unknown family {example.family!r}")
    code_verdicts = _score_code_batch(
        [examples[i] for i in code_indices], [responses[i] for i in code_indices], timeout
    )
    for i, verdict in zip(code_indices, code_verdicts):
        verdicts[i] = verdict
    return verdicts


def score(example: Example, response: str) -> bool:
    """Whether `response` does what `example` asked (see the family's scorer)."""
    return score_many([example], [response])[0]


def to_chat_record(example: Example) -> dict:
    """The example as one chat-JSONL record: its messages plus the reference answer."""
    messages = [dict(message) for message in example.messages]
    return {"messages": [*messages, {"role": "assistant", "content": example.answer}]}
