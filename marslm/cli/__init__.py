"""The ``marslm`` command: one module per subcommand, its parser beside its handler.

Each module has ``COMMAND``, ``add_parser(subparsers)`` and ``run(args) -> exit status``. The
method's commands come first; the tooling commands (``marslm/demo/``, ``bench/``, ``eval/``) after them.
Mistakes a user can fix (a bad path, a malformed file, a flag out of range) print one line to
stderr and exit with status 2; nothing is half-written. Heavy imports (torch, transformers)
happen inside the handlers, so ``marslm --help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import import_module

from ..errors import EXIT_USAGE, UserError

METHOD = ("train", "generate", "evaluate", "serve", "convert", "distill", "probe")
TOOLING = ("demo", "ablate", "bench", "loadtest", "plot", "show")


class _Parser(argparse.ArgumentParser):
    """argparse, but a command line it refuses is one line and a pointer to the help, not the usage
    block (subcommand parsers are made of the same class)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="marslm",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MARS: fine-tune a Hugging Face causal LM to emit several tokens per forward pass, "
        "and decode with it.",
        epilog="the method: train, generate, eval, serve, convert, distill, probe\n"
        "tooling: demo, ablate, bench, loadtest, plot, show",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in METHOD + TOOLING:
        import_module(f".{name}", __name__).add_parser(sub)
    return parser


def _quiet_libraries() -> None:
    """Keep our progress bars; drop the per-file load/save bars and advisory warnings of the libraries."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    # peft asks transformers a deprecated question on every LoRA run: two lines of noise before any error
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="marslm: %(message)s")
    try:
        args = build_parser().parse_args(argv)
    except UserError as exc:  # an option's own parser refused its text (settings.setting(parse=...))
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), "")
        print(f"marslm {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _quiet_libraries()
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
        return status
    except UserError as exc:
        print(f"marslm {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"marslm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of stdout went away (``marslm probe --json | head``): stop quietly, as Python's
    documentation advises, pointing stdout at devnull so the flush at exit cannot raise again."""
    import os

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
