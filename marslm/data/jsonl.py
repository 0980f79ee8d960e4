"""Chat SFT data from JSONL: one ``{"messages": [{"role", "content"}, ...]}`` per line.

Errors name the file and line, because a 100k-line file with one bad record is the usual case.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

ROLES = {"system", "user", "assistant", "tool"}


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: each message needs a role in {sorted(ROLES)} and a string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: conversation has no assistant turn")
    return messages


def read_chat_jsonl(path: str | Path) -> list[list[dict]]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read data file {path}: {exc.__class__.__name__}: {exc}") from None
    conversations = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: malformed JSON ({exc.msg})") from None
        if not isinstance(record, dict) or "messages" not in record:
            raise UserError(f"{where}: expected an object with a 'messages' list")
        conversations.append(_check_messages(record["messages"], where))
    if not conversations:
        raise UserError(f"{path}: no records (the file is empty)")
    return conversations
