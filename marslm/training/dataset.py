"""The training data as the model sees it: encoded examples, cached by content, and teacher rows.

Encoding is keyed by what it depends on (the data file's bytes, the tokenizer, the stop ids, the
settings that choose and cut examples), so a second run with the same key reads the cache instead
of encoding again, and a changed file is never mistaken for the cached one (cache.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..chat import encode_conversation, encode_generated
from ..errors import UserError
from .cache import cached, digest, encoding_problem, file_sha256, model_identity, teacher_problem, tokenizer_identity
from .config import TrainConfig

log = logging.getLogger("marslm.train")


def generated_answers(cfg: TrainConfig, vocab_size: int | None = None) -> list[dict] | None:
    """The distill records of DATA (and of its cut answers with ``cut_answers``), each checked
    against the vocabulary, when DATA is a ``marslm distill`` file and ``answer_ids`` is on; None:
    train on the conversations' text."""
    from ..data.distilled import is_distill_file, read_answers

    if not cfg.answer_ids or not is_distill_file(cfg.data):
        return None
    records = list(read_answers(cfg.data, include_unfinished=cfg.cut_answers, vocab_size=vocab_size).values())
    return records[: cfg.data_n] if cfg.data_n else records


def encode_dataset(tokenizer, conversations, max_length: int, stop_ids, eos_id: int, generated=None):
    """Encode every conversation (or generated answer); return (examples, truncated count, dropped count)."""
    examples, truncated, dropped = [], 0, 0
    for item in generated if generated is not None else conversations:
        if generated is not None:
            enc = encode_generated(
                tokenizer, item["messages"], item["answer_ids"], item.get("finished", True), eos_id, max_length
            )
        else:
            enc = encode_conversation(tokenizer, item, max_length=max_length, stop_ids=stop_ids)
        truncated += enc.truncated
        if all(label < 0 for label in enc.labels[1:]):
            dropped += 1  # truncation left no target to learn
            continue
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    if not examples:
        raise UserError("no trainable examples: every conversation lost its answer to --max-length")
    return examples, truncated, dropped


def encoding_key(cfg: TrainConfig, tokenizer, stop_ids: list[int], eos_id: int) -> str:
    """What the encoded examples depend on: the data's bytes, the tokenizer (cache.tokenizer_identity),
    the ids that end a turn and the settings that choose and cut examples. Two runs with the same
    key get the same examples."""
    from ..data.distilled import unfinished_path

    data = Path(cfg.data)
    files = [file_sha256(p) if p.is_file() else None for p in (data, unfinished_path(data))]
    settings = [cfg.data if not data.is_file() else "", cfg.data_n, cfg.data_seed, cfg.data_mix]
    settings += [cfg.max_length, cfg.answer_ids, cfg.cut_answers, stop_ids, eos_id]
    return digest(files, settings, tokenizer_identity(tokenizer))


def cached_encoding(data_key: str, encode, inputs: int, vocab_size: int):
    """``encode()``'s ``(examples, truncated, dropped)`` of ``inputs`` conversations, computed once
    per :func:`encoding_key`."""

    def compute():
        examples, truncated, dropped = encode()
        return {"examples": examples, "truncated": truncated, "dropped": dropped}

    value = cached(data_key, compute, lambda v: encoding_problem(v, inputs, vocab_size))
    return value["examples"], value["truncated"], value["dropped"]


def with_teacher(cfg: TrainConfig, data_key: str, model, examples: list[dict], pad_id: int) -> list[dict]:
    """The examples with the starting model's top-k at every label (teacher.py), when a soft
    target asks for it; computed once per encoded dataset (``data_key``), model and k."""
    if cfg.exact or not (cfg.soft_clean or cfg.soft_masked):
        return examples  # exact mode's teacher is its own clean stream (exact.exact_mars_loss)
    from accelerate import PartialState

    from .teacher import teacher_top_k

    key = "teacher-" + digest(data_key, cfg.teacher_top_k, model_identity(cfg.model, model))
    vocab_size = model.get_output_embeddings().weight.shape[0]
    model.to(PartialState().device)
    tops = cached(
        key,
        lambda: teacher_top_k(model, examples, cfg.teacher_top_k, pad_id, cfg.progress),
        lambda v: teacher_problem(v, examples, cfg.teacher_top_k, vocab_size),
    )
    return [ex | top for ex, top in zip(examples, tops, strict=True)]
