"""Crash-safe training checkpoints: a checkpoint counts only once every file of it is written.

Trainer writes ``checkpoint-N/`` file by file, so a kill part way leaves a directory that looks
like a checkpoint (and resuming from it fails for good). Once Trainer has written everything, a
marker listing every file and its size is renamed into place, last: a checkpoint is complete iff
the marker is there and every file it lists has that size. Light on purpose (no transformers):
``marslm train`` decides whether it resumes before anything heavy loads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("marslm.train")

CHECKPOINT_MARKER = "marslm-complete.json"


def mark_checkpoint_complete(directory: Path) -> None:
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != CHECKPOINT_MARKER
    }
    tmp = directory / (CHECKPOINT_MARKER + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, directory / CHECKPOINT_MARKER)


def checkpoint_is_complete(directory: Path) -> bool:
    try:
        files = json.loads((directory / CHECKPOINT_MARKER).read_text())["files"]
        return bool(files) and all((directory / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _checkpoint_step(path: Path) -> int:
    suffix = path.name.removeprefix("checkpoint-")
    return int(suffix) if suffix.isdigit() else -1


def resume_point(partial_dir: Path, resume: bool) -> Path | None:
    """The newest complete checkpoint to resume from (None: start afresh). What a kill left
    half-written is deleted: incomplete checkpoints and an unfinished final directory. Without
    ``resume`` everything from an earlier run goes."""
    if not partial_dir.is_dir():
        return None
    if not resume:
        shutil.rmtree(partial_dir)
        return None
    shutil.rmtree(partial_dir / "final", ignore_errors=True)
    newest = None
    for path in sorted(partial_dir.glob("checkpoint-*"), key=_checkpoint_step, reverse=True):
        if newest is None and checkpoint_is_complete(path):
            newest = path
        elif not checkpoint_is_complete(path):
            log.warning("removing %s: an interrupted run left it incomplete", path)
            shutil.rmtree(path)
    return newest
