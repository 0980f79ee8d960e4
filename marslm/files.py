"""Writing result files: always whole, never half (a crash or a kill leaves the old file or none)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .errors import UserError


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise UserError(f"cannot write {path}: {exc}") from None


def write_json_atomically(path: str | Path, payload: dict) -> None:
    write_text_atomically(path, json.dumps(payload, indent=2) + "\n")
