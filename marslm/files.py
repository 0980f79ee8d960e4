"""Files in and out: JSON read so that any bad input is one line, output paths checked before any
work, result files written whole, never half (a crash or a kill leaves the old file or none)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from .errors import UserError


def cache_root() -> Path:
    """Where marslm keeps what it can compute again (tokenised data, exported adapters):
    ``$MARSLM_CACHE``, else ``~/.cache/marslm``."""
    return Path(os.environ.get("MARSLM_CACHE") or Path.home() / ".cache" / "marslm")


def parse_json(text: str, path: str | Path, line: int | None = None, hint: str = "") -> object:
    """The JSON value of ``text``, read from ``path`` (at ``line``, for a JSONL file), or one
    UserError line naming the file and, where known, the line; ``hint`` (what the user can do)
    ends it.

    Beyond JSONDecodeError, ``json.loads`` raises RecursionError on deep nesting and ValueError
    on an integer longer than Python converts: input any file can hold.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        reason, line = exc.msg, line or exc.lineno
    except RecursionError:
        reason = "nested too deeply"
    except ValueError:
        reason = f"an integer longer than {sys.get_int_max_str_digits()} digits"
    where = f"{path}:{line}" if line else str(path)
    raise UserError(f"{where}: malformed JSON ({reason}){hint}")


def read_json(path: str | Path, hint: str = "") -> object:
    """The JSON value in the file ``path`` (errors as :func:`parse_json`'s)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc.__class__.__name__}: {exc}{hint}") from None
    return parse_json(text, path, hint=hint)


def output_file(path: str | Path, flag: str) -> Path:
    """``path`` as a file to write, refused in one line (before any work) where no file can go."""
    path = Path(path)
    _names_fit(path, flag)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file path")
    _parent_is_a_directory(path, flag)
    return path


def output_directory(path: str | Path, flag: str) -> Path:
    """``path`` as a directory to write into, refused in one line (before any work) where it cannot be one."""
    path = Path(path)
    _names_fit(path, flag)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a directory")
    _parent_is_a_directory(path, flag)
    return path


def make_directory(path: Path, flag: str) -> Path:
    """Create ``path`` (and its parents), or one line naming ``flag`` where the system refuses."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot create it ({exc.strerror or exc})") from None
    return path


def _names_fit(path: Path, flag: str) -> None:
    """Each name in ``path`` at most NAME_MAX bytes: a longer one fails every call that touches it."""
    longest = max((len(os.fsencode(part)) for part in path.parts), default=0)
    if longest > NAME_MAX:
        raise UserError(f"{flag} {path}: a name in it is {longest} bytes; file names hold at most {NAME_MAX}")


def _parent_is_a_directory(path: Path, flag: str) -> None:
    """Where ``path`` would be created: under a directory this process may write into."""
    existing = next((p for p in path.absolute().parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, not a directory")
    if existing is not None and not path.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: cannot create it, {existing} is not writable")
    if existing is not None and not path.exists():
        _try_creating_in(existing, path, flag)


def _try_creating_in(directory: Path, path: Path, flag: str) -> None:
    """``os.access`` answers yes to root wherever the mode bits allow, also in /proc and /sys, where
    nothing can be created: only trying tells (a directory made and removed at once)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".marslm-probe-", dir=directory))
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot create it in {directory} ({exc.strerror or exc})") from None


# The longest file name (one path component) POSIX file systems take, in bytes.
NAME_MAX = 255


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; a report is as readable as any file
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise UserError(f"cannot write {path}: {exc}") from None


def write_json_atomically(path: str | Path, payload: dict) -> None:
    write_text_atomically(path, json.dumps(payload, indent=2) + "\n")
