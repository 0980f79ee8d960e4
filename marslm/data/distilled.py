"""The distilled-answers file (``marslm distill``'s output), as training and the probe read it.

One JSON line per answer, ``{"id", "source", "messages": [..., {"role": "assistant", ...}],
"answer_ids", "finished"}``; an answer cut at ``max_new_tokens`` goes to the twin file
``OUTPUT.unfinished.jsonl``. A killed run may leave a cut last line: readers skip it, and the next
run repairs it before appending.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError
from ..files import parse_json
from .jsonl import jsonl_lines


def unfinished_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name.removesuffix(".jsonl") + ".unfinished.jsonl")


def done_ids(output: str | Path) -> set[str]:
    """Ids already answered in ``output`` and its unfinished file (only the ids: a resumed run
    rewrites nothing else)."""
    return {record["id"] for path in (Path(output), unfinished_path(output)) for _, record in _records(path)}


def is_distill_file(path: str | Path) -> bool:
    """Whether ``path`` is a distill output: a file whose first record has ``answer_ids``."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False  # not a distill file: the chat reader says what is wrong with it
    return isinstance(first, dict) and "answer_ids" in first


def read_answers(output: str | Path, include_unfinished: bool = True, vocab_size: int | None = None) -> dict[str, dict]:
    """``{id: record}`` of a distill output (and its unfinished file), every record checked once
    (:func:`check_record`) and every id unique: a repeated one would silently train as one."""
    paths = [Path(output)] + ([unfinished_path(output)] if include_unfinished else [])
    answers, first_seen = {}, {}
    for path in paths:
        for where, record in _records(path):
            check_record(record, where, vocab_size)
            if record["id"] in answers:
                raise UserError(f"{where}: id {record['id']!r} repeats the record at {first_seen[record['id']]}")
            answers[record["id"]], first_seen[record["id"]] = record, where
    return answers


def check_record(record: dict, where: str, vocab_size: int | None = None) -> None:
    """A distill record as training and the probe read it: messages, token ids, ``finished``."""
    from .jsonl import record_to_messages

    if not isinstance(record.get("messages"), list):
        found = "missing" if "messages" not in record else f"got {type(record['messages']).__name__}"
        raise UserError(f"{where}: a distill record needs a 'messages' list ({found})")
    record_to_messages(record, where)
    check_answer_ids(record.get("answer_ids"), where, vocab_size)
    if not isinstance(record.get("finished", True), bool):
        raise UserError(f"{where}: 'finished' must be true or false, got {record['finished']!r}")


def check_answer_ids(ids, where: str, vocab_size: int | None = None) -> None:
    """``answer_ids``: a list of token ids, each an integer in the vocabulary (JSON's true and 1.0
    are no token id, nor is the text "123", whose characters would be taken one by one)."""
    if not isinstance(ids, list):
        found = "missing" if ids is None else f"got {type(ids).__name__}"
        raise UserError(f"{where}: 'answer_ids' must be a list of token ids ({found})")
    high = vocab_size if vocab_size is not None else float("inf")
    bad = [t for t in ids if type(t) is not int or not 0 <= t < high][:1]
    if bad:
        within = f"integers in 0..{vocab_size - 1}" if vocab_size is not None else "integers >= 0"
        raise UserError(f"{where}: 'answer_ids' holds {bad[0]!r}; token ids are {within}")


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of an output file; a last line that a kill cut short is not one (it is redone)."""
    if not path.is_file():
        return
    try:
        *lines, last = jsonl_lines(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc.__class__.__name__}: {exc}") from None
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            record = parse_json(line, path, lineno)
            if not _is_record(record):
                raise UserError(f"{path}:{lineno}: not a distill record (a JSON object with an 'id')")
            yield f"{path}:{lineno}", record
    record = _whole_record(last)
    if record is not None:
        yield f"{path}:{len(lines) + 1}", record


def _is_record(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("id"), str)


def _whole_record(line: str | bytes) -> dict | None:
    """The record on a last line that has no newline, or None if it is not one: a kill mid-write
    leaves a strict prefix of a JSON object, and no such prefix parses."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if _is_record(record) else None


def end_with_a_whole_line(path: Path) -> None:
    """The last line of a killed run's file: a whole record gets the newline it lacks, a cut one goes."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    if _whole_record(data[data.rfind(b"\n") + 1 :]) is not None:
        with path.open("ab") as f:
            f.write(b"\n")
    else:
        path.write_bytes(data[: data.rfind(b"\n") + 1])
