"""The training data as the model sees it: encoded examples, cached by content, and teacher rows.

Encoding is keyed by what it depends on (the data file's bytes, the tokenizer, the settings that
choose and cut examples), so a second run with the same key reads the cache instead of encoding
again, and a changed file is never mistaken for the cached one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ..chat import encode_conversation, encode_generated
from ..errors import UserError
from .config import TrainConfig

log = logging.getLogger("marslm.train")


def generated_answers(cfg: TrainConfig) -> list[dict] | None:
    """The distill records of DATA (and of its cut answers with ``cut_answers``) when DATA is a
    ``marslm distill`` file and ``answer_ids`` is on; None: train on the conversations' text."""
    from ..distill import read_answers, unfinished_path

    path = Path(cfg.data)
    if not cfg.answer_ids or not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        first = f.readline()
    try:
        if "answer_ids" not in json.loads(first):
            return None
    except (ValueError, TypeError):
        return None  # not a distill file: the chat reader says what is wrong with it
    records = list(read_answers(path, include_unfinished=False).values())
    if cfg.cut_answers:
        records += list(read_answers(unfinished_path(path), include_unfinished=False).values())
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


def cache_dir() -> Path:
    """Where tokenised datasets are kept: ``$MARSLM_CACHE``, else ``~/.cache/marslm``."""
    return Path(os.environ.get("MARSLM_CACHE") or Path.home() / ".cache" / "marslm") / "tokenized"


def encoding_key(cfg: TrainConfig, tokenizer) -> str:
    """What the encoded examples depend on: the data's bytes, the tokenizer and the settings that
    choose and cut examples. Two runs with the same key get the same examples."""
    digest = hashlib.sha256()
    for path in (
        Path(cfg.data),
        Path(cfg.data).with_name(Path(cfg.data).name.removesuffix(".jsonl") + ".unfinished.jsonl"),
    ):
        if path.is_file():
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    settings = [cfg.data if not Path(cfg.data).is_file() else "", cfg.data_n, cfg.data_seed, cfg.data_mix]
    settings += [
        cfg.max_length,
        cfg.answer_ids,
        cfg.cut_answers,
        tokenizer.chat_template,
        sorted(tokenizer.get_vocab().items()),
    ]
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:24]


def cached(key: str, compute):
    """``compute()``, kept under ``cache_dir()/key.pt`` and read from there the next time.

    Under ``accelerate launch`` the main process computes first and writes the cache; the other
    ranks then read it instead of each computing it again.
    """
    from accelerate import PartialState

    path = cache_dir() / f"{key}.pt"
    with PartialState().main_process_first():
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except Exception:  # noqa: BLE001 - an unreadable cache is computed again and replaced
                log.warning("ignoring an unreadable cache %s", path)
        value = compute()
        if PartialState().is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(value, tmp)
            os.replace(tmp, path)
    return value


def cached_encoding(data_key: str, encode):
    """``encode()``'s ``(examples, truncated, dropped)``, computed once per :func:`_encoding_key`."""

    def compute():
        examples, truncated, dropped = encode()
        return {"examples": examples, "truncated": truncated, "dropped": dropped}

    value = cached(data_key, compute)
    return value["examples"], value["truncated"], value["dropped"]


def _model_identity(model_name: str) -> list:
    """What tells one starting model from another: the hub id, or a directory's weight files."""
    path = Path(model_name)
    if not path.is_dir():
        return [model_name]
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    return [str(path.resolve())] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]


def with_teacher(cfg: TrainConfig, data_key: str, model, examples: list[dict], pad_id: int) -> list[dict]:
    """The examples with the starting model's top-k at every label (teacher.py), when a soft
    target asks for it; computed once per encoded dataset (``data_key``), model and k."""
    if cfg.exact or not (cfg.soft_clean or cfg.soft_masked):
        return examples  # exact mode's teacher is its own clean stream (objective.exact_mars_loss)
    from accelerate import PartialState

    from .teacher import teacher_top_k

    key = json.dumps([data_key, cfg.teacher_top_k, _model_identity(cfg.model)], default=str)
    digest = "teacher-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    model.to(PartialState().device)
    tops = cached(digest, lambda: teacher_top_k(model, examples, cfg.teacher_top_k, pad_id, cfg.progress))
    return [ex | top for ex, top in zip(examples, tops)]
