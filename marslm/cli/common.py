"""What several subcommands share: flags, code execution, JSON output."""

from __future__ import annotations

import argparse
from contextlib import contextmanager

from ..errors import UserError

EXIT_FAILED_CELLS = 1  # eval: some settings failed (out of memory, say); the rest is reported


def add_device(parser) -> None:
    parser.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")


# DecoderOptions' fields that let a step read no masks where they do not pay (rules.py)
FALLBACK_OPTIONS = ("adaptive_width", "mask_batch_limit")


def add_fallback(parser) -> None:
    """``--[no-]adaptive-width`` and ``--mask-batch-limit N|auto``, with ``DecoderOptions``'
    defaults and help."""
    import dataclasses

    from ..decode.params import DecoderOptions
    from ..settings import add_options

    fields = {f.name: f for f in dataclasses.fields(DecoderOptions)}
    parser.add_argument(
        "--adaptive-width",
        action=argparse.BooleanOptionalAction,
        default=fields["adaptive_width"].default,
        help=fields["adaptive_width"].metadata["help"],
    )
    add_options(parser, DecoderOptions, skip=tuple(name for name in fields if name != "mask_batch_limit"))


def add_dtype(parser) -> None:
    from ..settings import DTYPE_NAMES

    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_NAMES,
        help="weights dtype to decode in (auto: as saved; bfloat16 is faster on a CPU with native bf16, "
        "and may round a near-tie differently from float32: docs/usage.md)",
    )


def add_compile(parser) -> None:
    """``--compile`` / ``--no-compile`` (unset: auto), with ``DecoderOptions``' help: a run option
    of generate, eval, bench and serve, whose settings objects carry it without a flag of their own."""
    import dataclasses

    from ..decode.params import DecoderOptions

    field = next(f for f in dataclasses.fields(DecoderOptions) if f.name == "compile")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=field.default,
        help=field.metadata["help"] + " (default: auto; --compile insists, --no-compile decodes eagerly)",
    )


def add_drafter(parser) -> None:
    """``--draft-model`` and ``--num-draft-tokens``, from ``DraftOptions``' fields."""
    from ..decode.draft_options import DraftOptions
    from ..settings import add_options

    add_options(parser, DraftOptions)


def load_drafter(args) -> dict:
    """``generate``'s drafting keywords from the parsed ``--draft-model`` / ``--num-draft-tokens``
    (checked before anything loads; none without a drafter)."""
    from ..decode.draft_options import DraftOptions
    from ..settings import from_args

    return from_args(DraftOptions, args).load(args.device)


def add_unsafe_exec(parser) -> None:
    parser.add_argument(
        "--unsafe-exec",
        action="store_true",
        help="where bubblewrap is unavailable, run model-written code (the code family, HumanEval) "
        "WITHOUT a sandbox: it can do whatever you can (default: refuse)",
    )


def code_execution(args, check_now: bool = False) -> None:
    """Apply --unsafe-exec; with ``check_now``, refuse before any slow work when code cannot run."""
    from ..data import sandbox

    sandbox.allow_unsafe_exec(args.unsafe_exec)
    if check_now:
        sandbox.require_isolation()


def write_json(path: str, payload: dict) -> None:
    from ..files import write_json_atomically

    write_json_atomically(path, payload)


@contextmanager
def allocation_errors(flags: str):
    """An allocation that fails (host or device memory) becomes one line naming what to lower."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        if not isinstance(exc, MemoryError) and not any(
            word in text for word in ("out of memory", "allocate", "Overflow", "overflow")
        ):
            raise
        raise UserError(f"out of memory ({text[:200]}); lower {flags}") from None


def load_for_decoding(model_path: str, params, device: str = "auto", decoder=None, dtype: str = "auto"):
    """``(model, tokenizer, params)`` for ``generate`` and ``show``: the settings checked, also
    against the block size the checkpoint was trained with, its context and whether it has a mask
    token, before the model loads, so that a refusal is the only line (loading warns about a
    checkpoint without marslm.json); a warning when an AR checkpoint is asked to accept untrained
    mask guesses."""
    from ..modeling import (
        check_model_source,
        load_model,
        model_context,
        resolve_device,
        saved_config,
        saved_mask_token,
        trained_block_size,
        warn_untrained_masks,
    )

    params.validate()
    check_model_source(model_path)
    config = saved_config(model_path)
    context = model_context(model_path)
    params = params.validate(trained_block_size(config), context)
    if decoder is not None:
        decoder.validate(params, context)
    if not params.one_token:
        params.check_mask_token(saved_mask_token(model_path))
    model, tokenizer, _ = load_model(model_path, dtype=dtype, device=resolve_device(device))
    if config is not None and config.stage == "ar" and not params.one_token:
        warn_untrained_masks(model_path, f"tau {params.tau:g}")
    return model, tokenizer, params
