"""What several subcommands share: flags, code execution, JSON output."""

from __future__ import annotations

import argparse

EXIT_USAGE = 2  # a mistake the user can fix: one line on stderr
EXIT_FAILED_CELLS = 1  # eval: some settings failed (out of memory, say); the rest is reported


def add_device(parser) -> None:
    parser.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")


def add_adaptive_width(parser) -> None:
    """``--adaptive-width`` and ``--no-adaptive-width``, with ``DecoderOptions``' default and help."""
    import dataclasses

    from ..decode.params import DecoderOptions

    field = {f.name: f for f in dataclasses.fields(DecoderOptions)}["adaptive_width"]
    parser.add_argument(
        "--adaptive-width",
        action=argparse.BooleanOptionalAction,
        default=field.default,
        help=field.metadata["help"],
    )


def add_unsafe_exec(parser) -> None:
    parser.add_argument(
        "--unsafe-exec",
        action="store_true",
        help="where bubblewrap is unavailable, run model-written code (the code family, HumanEval) "
        "WITHOUT a sandbox: it can do whatever you can (default: refuse)",
    )


def code_execution(args, check_now: bool = False) -> None:
    """Apply --unsafe-exec; with ``check_now``, refuse before any slow work when code cannot run."""
    from .. import sandbox

    sandbox.allow_unsafe_exec(args.unsafe_exec)
    if check_now:
        sandbox.require_isolation()


def write_json(path: str, payload: dict) -> None:
    from ..files import write_json_atomically

    write_json_atomically(path, payload)


def load_for_decoding(model_path: str, params, device: str = "auto"):
    """``(model, tokenizer, params)`` for ``generate`` and ``show``: the settings checked, also
    against the block size the checkpoint was trained with, before the model loads, so that a
    refusal is the only line (loading warns about a checkpoint without marslm.json); a warning
    when an AR checkpoint is asked to accept untrained mask guesses."""
    import logging

    from ..config import MarsConfig
    from ..modeling import check_model_source, load_model, resolve_device, trained_block_size

    params.verify()
    check_model_source(model_path)
    config = MarsConfig.load(model_path)
    params = params.verify(trained_block_size(config))
    model, tokenizer, _ = load_model(model_path, device=resolve_device(device))
    if config is not None and config.stage == "ar" and not params.one_token:
        logging.getLogger("marslm").warning(
            "%s is an AR checkpoint (marslm.json stage 'ar'): its masks were never trained, so tau %g accepts "
            "untrained guesses; use tau 1, or a MARS checkpoint",
            model_path,
            params.tau,
        )
    return model, tokenizer, params
