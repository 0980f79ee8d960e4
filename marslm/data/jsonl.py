"""Chat SFT data from JSONL, in the shapes public instruction datasets come in.

Each line is one record; its shape is detected per record, so a file may even mix them:

    messages            {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
    Alpaca              {"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)}
    prompt/completion   {"prompt": "...", "completion": "..."}  or, TRL's conversational form,
                        {"prompt": [messages], "completion": [assistant messages]}
    ShareGPT            {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}

Every shape becomes a message list with at least one assistant turn (the training loss goes on
assistant turns only). Errors name the file and line, because a 100k-line file with one bad
record is the usual case.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError
from ..files import parse_json

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
SHAPES = "{messages}, Alpaca {instruction, output}, {prompt, completion} or ShareGPT {conversations}"


# ---------------------------------------------------------------------------- reading records


def read_jsonl_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for each non-blank line; ``where`` is ``"path:line"`` for error messages.

    Shared with the evaluation loaders (gsm8k.py, humaneval.py).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"data file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read data file {path}: {exc.__class__.__name__}: {exc}") from None
    empty = True
    for lineno, line in enumerate(jsonl_lines(text), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        record = parse_json(line, path, lineno)
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if _SURROGATE_ESCAPE.search(line):  # the file is UTF-8, so only an escape can make one
            try:
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise UserError(
                    f"{where}: a string holds a lone surrogate escape "
                    f"({_SURROGATE_ESCAPE.search(line).group()}): not valid Unicode text"
                ) from None
        empty = False
        yield where, record
    if empty:
        raise UserError(f"{path}: no records (the file is empty)")


def in_id_order(items: list, id_of) -> list:
    """``items`` in the order of a hash of their ids: a fixed order that does not depend on the order
    a file was written in. A batched ``marslm distill`` writes each answer as it finishes, short ones
    first, so a file's first N records are its N shortest, not a sample."""
    return sorted(items, key=lambda item: hashlib.sha256(str(id_of(item)).encode()).hexdigest())


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text. Only "\\n" ends one: a JSON string may hold U+2028, U+2029 or
    U+0085 unescaped, and ``str.splitlines`` splits there too."""
    return text.split("\n")


def first_record(path: str | Path) -> dict:
    """The first record of a JSONL file, to tell which format the file is in."""
    return next(read_jsonl_records(path))[1]


def require_strings(record: dict, keys: tuple[str, ...], where: str, what: str) -> None:
    """Every key present with a string value, or one line saying which one is not."""
    for key in keys:
        if not isinstance(record.get(key), str):
            found = "missing" if key not in record else f"got {type(record[key]).__name__}"
            raise UserError(f"{where}: a {what} record needs a string '{key}' ({found}); keys: {sorted(record)}")


# ---------------------------------------------------------------------------- chat shapes


def _check_messages(messages, where: str, field: str = "messages", need_assistant: bool = True) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: '{field}' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: each message needs a role in {sorted(ROLES)} and a string content")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: conversation has no assistant turn")
    return messages


def _from_alpaca(record: dict, where: str) -> list[dict]:
    require_strings(record, ("instruction", "output"), where, "Alpaca")
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise UserError(f"{where}: Alpaca 'input' must be a string")
    system = record.get("system") or ""
    # Alpaca's own prompt puts the input below the instruction; the chat template does the rest.
    user = record["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


def _from_prompt_completion(record: dict, where: str) -> list[dict]:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list):
        head = _check_messages(prompt, where, "prompt", need_assistant=False)
        tail = _check_messages(completion, where, "completion")
        return head + tail
    raise UserError(f"{where}: 'prompt' and 'completion' must both be strings or both message lists")


def _from_sharegpt(record: dict, where: str) -> list[dict]:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'conversations' must be a non-empty list")
    messages = []
    for turn in turns:
        role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            raise UserError(
                f"{where}: each ShareGPT turn needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value'"
            )
        messages.append({"role": role, "content": turn["value"]})
    return _check_messages(messages, where, "conversations")


def record_to_messages(record: dict, where: str) -> list[dict]:
    """One record, whatever its shape, as a chat message list with an assistant turn."""
    if "messages" in record:
        return _check_messages(record["messages"], where)
    if "instruction" in record and "output" in record:
        return _from_alpaca(record, where)
    if "prompt" in record and "completion" in record:
        return _from_prompt_completion(record, where)
    if "conversations" in record:
        return _from_sharegpt(record, where)
    raise UserError(f"{where}: unknown record shape (keys: {sorted(record)}); expected {SHAPES}")


def read_chat_jsonl(path: str | Path) -> list[list[dict]]:
    """Every record of a chat SFT JSONL file as a message list (see the module docstring for shapes)."""
    return [record_to_messages(record, where) for where, record in read_jsonl_records(path)]
