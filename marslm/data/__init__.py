"""Data sources for training and evaluation, behind one name: ``--data toy`` or a JSONL path."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .jsonl import read_chat_jsonl

TOY = "toy"


def check_mix(source: str, mix: dict[str, float] | None) -> None:
    """Refuse a family mixture (``--data-mix``) that is not for the toy suite or names bad weights."""
    if not mix:
        return
    if source != TOY:
        raise UserError(f"--data-mix applies to --data {TOY} only, not {source}")
    from . import toy

    try:
        toy.check_weights(mix)
    except ValueError as exc:
        raise UserError(f"--data-mix: {exc}") from None


def load_conversations(
    source: str, split: str = "train", n: int | None = None, seed: int = 0, mix: dict[str, float] | None = None
) -> list[list[dict]]:
    """Chat conversations (message lists, assistant turns included) from a named source.

    ``mix`` weights the toy suite's families (e.g. ``{"lists": 2}``); files are taken as they are.
    """
    check_mix(source, mix)
    if source == TOY:
        from . import toy

        examples = toy.make_split(split, n or 20000, seed=seed, weights=mix)
        return [toy.to_chat_record(ex)["messages"] for ex in examples]
    if not Path(source).exists():
        raise UserError(f"data file not found: {source} (use a chat JSONL path or 'toy')")
    conversations = read_chat_jsonl(source)
    return conversations[:n] if n else conversations
