"""Whether a decoder compiles its step, and where the compiled graphs are kept between processes.

``compile="auto"`` (the default of ``generate``, ``eval``, ``bench`` and ``serve``) compiles the
cursor cache's step (forward.py) where it pays: where torch's inductor can generate code for the
device (CUDA; a CPU with a C++ compiler), and for a decoder that lives long (a server) or a call
with enough to decode (``AUTO_COMPILE_WORK``). Even with its kernels kept on disk, a graph costs a
process seconds to trace and load, more than a small call's steps save. Where inductor cannot
compile it decodes eagerly and says why, once per process. ``MARSLM_COMPILE=off`` in the
environment makes ``auto`` mean eager on that machine (a test suite, a box whose compiler is
broken); ``compile=False`` opts one call out; ``compile=True`` insists, and is refused in one line
where it cannot run.

What inductor builds (each graph's generated kernels, its FX-graph and AOT-autograd entries) is
kept in marslm's cache, ``$MARSLM_CACHE/inductor`` (unless ``TORCHINDUCTOR_CACHE_DIR`` names
another place). Inductor keys every entry by the traced graph (shapes and dtypes included),
torch's version and the device, so a later process on the same machine loads the kernels instead
of generating them, and an entry made by another torch, device or dtype is never read. Weights
are graph inputs, not constants: checkpoints of one architecture share entries. A damaged entry
is skipped and rebuilt by inductor itself (the output is the same, since the graph is); its
multi-line report is folded here into one warning line.
"""

from __future__ import annotations

import logging
import os
import shutil

from ..errors import UserError
from ..files import cache_root

COMPILE_SETTINGS = (True, False, "auto")
# tokens a call may decode (prompts x max_new_tokens) before auto compiles it; docs/results.md has
# what a graph costs a process to trace and load, and what a compiled step saves
AUTO_COMPILE_WORK = 16384
COMPILE_ENV = "MARSLM_COMPILE"  # auto's answer on this machine: off (eager) or auto (the default)
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # read by inductor each time it opens its cache

log = logging.getLogger("marslm.compile")
_said: set[str] = set()  # the fallback reasons already said in this process


def check_compile(value) -> None:
    if not (value is True or value is False or value == "auto"):
        raise UserError(f"compile must be True, False or 'auto', got {value!r}")


def cannot_compile(device) -> str | None:
    """Why inductor cannot compile for ``device`` here (a torch.device, a name such as ``cuda:1``,
    or None: the CPU, as ``modeling.resolve_device`` says), or None where it can."""
    kind = "cpu" if device is None else getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        return None
    if kind != "cpu":
        return f"inductor has no code generator marslm relies on for {kind}"
    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        return "no C++ compiler (g++, c++ or clang++ on PATH) for inductor's CPU kernels"
    return None


def resolve_compile(setting, cache: str, device, work: int | None = None) -> bool:
    """Whether a decoder with ``compile=setting`` and ``cache`` compiles its step on ``device``;
    ``work``: the tokens the call may decode, None for a decoder that lives long (a server).

    ``auto``: yes for the cursor cache where :func:`cannot_compile` finds nothing against it,
    ``MARSLM_COMPILE`` is not ``off`` and ``work`` is None or above ``AUTO_COMPILE_WORK``;
    otherwise eager, saying why once where the device is why (the block cache and no cache have
    no compiled step, and a small call is eager by choice: no word)."""
    check_compile(setting)
    if setting is False or cache != "cursor":
        return False
    if setting is True:
        reason = cannot_compile(device)
        if reason:
            raise UserError(f"compile=True: {reason}; decode eagerly with --no-compile")
        return True
    chosen = os.environ.get(COMPILE_ENV, "auto").strip().lower()
    if chosen in ("off", "0", "false", "no"):
        return False
    if chosen not in ("auto", "", "on", "1", "true", "yes"):
        raise UserError(f"{COMPILE_ENV} must be auto or off, got {chosen!r}")
    if work is not None and work <= AUTO_COMPILE_WORK:
        return False
    reason = cannot_compile(device)
    if reason:
        if reason not in _said:
            _said.add(reason)
            log.warning("compile auto: %s; decoding eagerly (--no-compile says this is meant)", reason)
        return False
    return True


def keep_compiled_graphs() -> str:
    """Point inductor's caches at marslm's (unless the user pointed them elsewhere) and fold its
    report of a damaged entry into one line; returns the folder. Called before the first compile."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the environment the first time it asks, so a value equal
    # to that default was not set by the user
    folder = os.environ.get(INDUCTOR_CACHE_ENV)
    if not folder or os.path.abspath(folder) == os.path.abspath(default_cache_dir()):
        folder = str(cache_root() / "inductor")
    os.environ[INDUCTOR_CACHE_ENV] = folder
    codecache = logging.getLogger("torch._inductor.codecache")
    if not any(isinstance(f, _OneLine) for f in codecache.filters):
        codecache.addFilter(_OneLine(folder))
    return folder


class _OneLine(logging.Filter):
    """Inductor logs a damaged cache entry with its traceback, and then rebuilds the entry: one
    warning line says as much."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.levelno >= logging.WARNING:
            reason = record.exc_info[1]
            record.msg = "a damaged compile-cache entry in %s was ignored and is being rebuilt (%s: %s)"
            record.args = (self.folder, type(reason).__name__, str(reason)[:120])
            record.exc_info = record.exc_text = None
        return True
