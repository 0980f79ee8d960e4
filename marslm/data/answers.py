"""Recorded answers as an evaluation set: chat records whose last assistant turn is the reference.

``marslm distill`` writes such a file (its held-out split is the original model's own greedy
answers to prompts of the training distribution). The prompt is every message before the last
one; a response is right when it is the recorded answer, surrounding whitespace aside. On a
distilled file that reads "decodes as the original did", which exact mode and lossless decoding
promise and threshold decoding trades for speed. Records marked ``"finished": false`` (answers cut
at the distillation's length limit) are skipped: their reference is not a whole answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .jsonl import in_id_order, read_jsonl_records, record_to_messages

FAMILY = "answers"
KEYS = ("messages",)


@dataclass(frozen=True)
class RecordedAnswer:
    id: str
    family: str  # the record's "source" where it names one (distill's), else "answers"
    messages: list[dict]  # the conversation before the recorded answer
    answer: str


def load_answers(path: str | Path, n: int | None = None) -> list[RecordedAnswer]:
    """``n`` finished records of a chat JSONL file (all of them when n is None), the first ``n`` in
    the order of their ids' hash (jsonl.in_id_order), whatever order the file holds them in."""
    examples = []
    for where, record in read_jsonl_records(path):
        messages = record_to_messages(record, where)
        if messages[-1]["role"] != "assistant":
            raise UserError(f"{where}: the last message must be the assistant's answer to compare against")
        if record.get("finished", True) is False:
            continue
        source = record.get("source")
        examples.append(
            RecordedAnswer(
                id=str(record.get("id", f"{FAMILY}-{len(examples)}")),
                family=source if isinstance(source, str) and source else FAMILY,
                messages=messages[:-1],
                answer=messages[-1]["content"],
            )
        )
    if not examples:
        raise UserError(f"{path}: no finished answers to evaluate against")
    return in_id_order(examples, lambda ex: ex.id)[:n]


def score_many(examples: Sequence[RecordedAnswer], responses: Sequence[str]) -> list[bool]:
    return [isinstance(r, str) and r.strip() == ex.answer.strip() for ex, r in zip(examples, responses, strict=True)]
