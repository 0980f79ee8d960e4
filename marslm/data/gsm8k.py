"""GSM8K-format evaluation files: ``{"question": ..., "answer": "...worked solution...\\n#### 42"}``.

The question becomes the user message as it stands (zero-shot, no added instruction). An answer
is right when its *final number* equals the reference's ``#### N``. The final number of a
response is, in order of preference: the number after the last ``####`` (GSM8K's own marker),
the number after the last "answer is", else the last number in the text. Numbers compare as
decimals with thousands separators, ``$`` and a trailing period removed (``1,000.00`` == ``1000``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from ..errors import UserError
from .jsonl import read_jsonl_records, require_strings

FAMILY = "gsm8k"
KEYS = ("question", "answer")

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_AFTER_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_AFTER_ANSWER_IS = re.compile(r"answer is\s*:?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


@dataclass(frozen=True)
class GSM8KExample:
    id: str
    family: str
    messages: list[dict]  # the question as one user message
    answer: str  # the reference solution, "#### N" line included
    target: str  # N, as written in the reference


def parse_number(text: str) -> Decimal | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def final_number(response: str) -> str | None:
    """The number a response commits to (see the module docstring), as written; None if none."""
    for pattern in (_AFTER_HASHES, _AFTER_ANSWER_IS, _ANY_NUMBER):
        found = pattern.findall(response)
        if found:
            return found[-1]
    return None


def is_correct(example: GSM8KExample, response: str) -> bool:
    got = final_number(response) if isinstance(response, str) else None
    return got is not None and parse_number(got) == parse_number(example.target)


def score_many(examples: Sequence[GSM8KExample], responses: Sequence[str]) -> list[bool]:
    return [is_correct(ex, r) for ex, r in zip(examples, responses, strict=True)]


def load_gsm8k(path: str | Path, n: int | None = None) -> list[GSM8KExample]:
    """The first ``n`` problems of a GSM8K-format JSONL file (all of them when n is None)."""
    examples = []
    for where, record in read_jsonl_records(path):
        require_strings(record, KEYS, where, "GSM8K")
        found = _AFTER_HASHES.findall(record["answer"])
        if not found or parse_number(found[-1]) is None:
            raise UserError(f"{where}: the GSM8K 'answer' has no final '#### <number>' line")
        examples.append(
            GSM8KExample(
                id=f"{FAMILY}-{len(examples)}",
                family=FAMILY,
                messages=[{"role": "user", "content": record["question"]}],
                answer=record["answer"],
                target=found[-1],
            )
        )
        if n is not None and len(examples) >= n:
            break
    return examples
