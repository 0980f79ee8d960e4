"""The probe's held-out items: a prompt encoded as training encodes it, and its reference answer
(a distill record's own token ids where it has them), read from a chat JSONL file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..chat import IGNORE, encode_conversation, stop_token_ids
from ..errors import UserError


@dataclass(frozen=True)
class ProbeItem:
    id: str
    source: str  # prompt family (a distill record's "source")
    prompt_ids: list[int]
    answer_ids: list[int]  # the reference; ends in the end-of-turn token when the answer finished


def probe_item(record: dict, tokenizer, where: str = "record", stop_ids: list[int] | None = None) -> ProbeItem | None:
    """One held-out item from a chat record: the prompt as training encodes it, and the reference.

    The reference is the record's ``answer_ids`` (a distill record: the original model's tokens,
    which re-tokenising its text need not give back), closed by the end-of-turn token training
    puts there when ``finished``; without ``answer_ids``, the first assistant turn's tokens.
    None when there is nothing to score (an unfinished, empty answer).
    """
    from ..data.jsonl import record_to_messages

    messages = record_to_messages(record, where)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    enc = encode_conversation(tokenizer, messages[: first + 1], stop_ids=stop_ids)
    start = next(t for t, label in enumerate(enc.labels) if label != IGNORE)
    turn = enc.labels[start:]  # the assistant turn, through its end-of-turn token
    if "answer_ids" in record:
        from ..data.distilled import check_answer_ids

        ids = record["answer_ids"]
        check_answer_ids(ids, where, len(tokenizer))
        answer = ids + ([turn[-1]] if record.get("finished", True) else [])
    else:
        answer = turn
    if not answer:
        return None
    return ProbeItem(str(record.get("id", where)), str(record.get("source", "-")), enc.input_ids[:start], answer)


def load_probe_items(
    path: str | Path, tokenizer, limit: int | None = None, context: int | None = None
) -> list[ProbeItem]:
    """Items of a chat JSONL file (a distill output, or any shape data/jsonl.py reads) and of its
    ``.unfinished.jsonl`` companion where distill wrote one (an answer cut at distill's token limit
    is still the original's greedy text, only shorter), the first ``limit`` in the order of their
    ids' hash (jsonl.in_id_order), whatever order the files hold them in. An item longer than
    ``context`` (the model's) is refused, naming its line."""
    from itertools import chain

    from ..data.distilled import unfinished_path
    from ..data.jsonl import in_id_order, read_jsonl_records

    if not Path(path).is_file():
        raise UserError(f"data file not found: {path}")
    stop_ids = stop_token_ids(tokenizer)
    files = [p for p in (Path(path), unfinished_path(path)) if p.is_file() and p.stat().st_size]
    items = []
    for where, record in chain(*map(read_jsonl_records, files)):
        item = probe_item(record, tokenizer, where, stop_ids)
        if item is None:
            continue
        tokens = len(item.prompt_ids) + len(item.answer_ids)
        if context is not None and tokens > context:
            raise UserError(f"{where}: the prompt and answer have {tokens} tokens; the model's context is {context}")
        items.append(item)
    if not items:
        raise UserError(f"{path}: no record has an answer token to score")
    return in_id_order(items, lambda item: item.id)[:limit]
