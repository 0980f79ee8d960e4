"""``marslm train``'s caches, the tokenised data and the teacher rows: keyed on what they depend on,
and checked when read.

A key hashes contents, never names, sizes or dates, since a key that misses a change would train on
stale rows without a word: the data's bytes, the tokenizer's whole definition (vocabulary, BPE
merges, added tokens), the chat template and the stop ids; for teacher rows also the model's
config and a content hash of its weights. A value read back is checked against what it must hold
(its type, its count, each row's length, its ids in the vocabulary); one that fails is named in
one line and computed again, so a damaged or foreign file costs time, never a wrong model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from itertools import chain
from pathlib import Path

import torch

from ..chat import IGNORE
from ..errors import UserError
from ..files import cache_root, output_directory, write_text_atomically

log = logging.getLogger("marslm.train")


def cache_dir() -> Path:
    """Where the tokenised data and teacher rows are kept, under :func:`~marslm.files.cache_root`."""
    return cache_root() / "tokenized"


def check_cache_dir() -> None:
    """Refuse, in one line and before any work, a cache directory that cannot be written."""
    path = cache_dir()
    output_directory(path.parent, "MARSLM_CACHE")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        raise UserError(f"MARSLM_CACHE: cannot write the cache directory {path} ({exc.strerror or exc})") from None


def digest(*parts) -> str:
    """A short hash of JSON-able ``parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def tokenizer_identity(tokenizer) -> list:
    """What an encoding depends on in a tokenizer: its full definition (a fast tokenizer's JSON holds
    the vocabulary, the merges, the added tokens and the normaliser) and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return [definition, tokenizer.chat_template, tokenizer.all_special_tokens]


def model_identity(model_name: str, model) -> list:
    """What teacher rows depend on in a model: its config and a content hash of its weights."""
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    path = Path(model_name)
    weights = _directory_weights(path) if path.is_dir() else None
    return [config, weights or _parameters_sha256(model)]


def weights_record(path: Path) -> Path:
    """Where a model directory's weight hashes are kept: in the cache, not in the directory (a hub
    snapshot or someone else's checkpoint is not ours to write into)."""
    return cache_dir() / "weights" / f"{digest(str(path.resolve()))}.json"


def _directory_weights(path: Path) -> dict | None:
    """``{file: sha256}`` of a model directory's weight files, hashed once per file version
    (:func:`weights_record`); a file's size, times and inode tell a version: a copy, even one that
    keeps the mtime, has a new ctime and inode, and so does a file written in place."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    if not files:
        return None
    record_path = weights_record(path)
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}
    record = record if isinstance(record, dict) else {}
    hashes, fresh = {}, {}
    for p in files:
        st = p.stat()
        stat = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        kept = record.get(p.name)
        if isinstance(kept, dict) and kept.get("stat") == stat and isinstance(kept.get("sha256"), str):
            hashes[p.name] = kept["sha256"]
        else:
            hashes[p.name] = file_sha256(p)
        fresh[p.name] = {"stat": stat, "sha256": hashes[p.name]}
    if fresh != record:
        write_text_atomically(record_path, json.dumps(fresh, indent=1))
    return hashes


def _parameters_sha256(model) -> str:
    """A content hash of a model's weights as loaded (a hub model has no directory to keep it in)."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def cached(key: str, compute: Callable, problem: Callable):
    """``compute()``, kept under ``cache_dir()/key.pt`` and read from there the next time, once
    ``problem(value)`` finds nothing wrong with what was read (else it is computed again).

    Under ``accelerate launch`` the main process computes first and writes the cache; the other
    ranks then read it instead of each computing it again.
    """
    from accelerate import PartialState

    path = cache_dir() / f"{key}.pt"
    with PartialState().main_process_first():
        if path.is_file():
            try:
                value = torch.load(path, weights_only=True)
                reason = problem(value)
            except Exception as exc:  # noqa: BLE001 - an unreadable cache is computed again and replaced
                reason = f"unreadable ({exc.__class__.__name__})"
            if reason is None:
                return value
            log.warning("ignoring the cache %s: %s; computing it again", path, reason)
        value = compute()
        if PartialState().is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(value, tmp)
            os.replace(tmp, path)
    return value


def encoding_problem(value, inputs: int, vocab_size: int) -> str | None:
    """What is wrong with a cached encoding of ``inputs`` conversations (None: nothing)."""
    if not isinstance(value, dict) or not {"examples", "truncated", "dropped"} <= set(value):
        return "not an encoding (a dict of examples, truncated, dropped)"
    examples, dropped = value["examples"], value["dropped"]
    if not isinstance(examples, list) or not examples or not isinstance(dropped, int):
        return "no examples"
    if len(examples) + dropped != inputs:
        return f"{len(examples)} examples and {dropped} dropped, for {inputs} conversations"
    for i, ex in enumerate(examples):
        ids, labels = (ex.get("input_ids"), ex.get("labels")) if isinstance(ex, dict) else (None, None)
        if not isinstance(ids, list) or not isinstance(labels, list) or len(ids) != len(labels) or not ids:
            return f"example {i} is not input_ids and labels of one length"
    # One tensor of every id: checked at C speed, not token by token (a float makes it a float tensor).
    ids = torch.tensor(list(chain.from_iterable(ex["input_ids"] for ex in examples)))
    labels = torch.tensor(list(chain.from_iterable(ex["labels"] for ex in examples)))
    if ids.dtype != torch.int64 or labels.dtype != torch.int64:
        return "a token id that is not an integer"
    labelled = labels[labels != IGNORE]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not ((labelled >= 0) & (labelled < vocab_size)).all():
        return f"a token id outside the vocabulary (0..{vocab_size - 1})"
    return None


def teacher_problem(value, examples: list[dict], k: int, vocab_size: int) -> str | None:
    """What is wrong with cached teacher rows for ``examples`` (None: nothing)."""
    if not isinstance(value, list) or len(value) != len(examples):
        count = len(value) if isinstance(value, list) else type(value).__name__
        return f"{count} teacher rows for {len(examples)} examples"
    for i, (row, ex) in enumerate(zip(value, examples)):
        ids, probs = (row.get("teacher_ids"), row.get("teacher_probs")) if isinstance(row, dict) else (None, None)
        shape = (len(ex["input_ids"]), k)
        if not isinstance(ids, torch.Tensor) or not isinstance(probs, torch.Tensor):
            return f"row {i} lacks teacher_ids or teacher_probs"
        if tuple(ids.shape) != shape or tuple(probs.shape) != shape:
            return f"row {i} is {tuple(ids.shape)}, not {shape} (its example's length by the top-k)"
        if ids.dtype.is_floating_point or (ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size):
            return f"row {i} holds a token id outside the vocabulary (0..{vocab_size - 1})"
        if not probs.isfinite().all() or (probs.numel() and not 0 <= float(probs.min()) <= float(probs.max()) <= 1):
            return f"row {i} holds a probability outside 0..1"
    return None
