"""``marslm eval``: accuracy and tokens per forward, a resumable sweep over models and settings."""

from __future__ import annotations

import argparse
import sys

from ..settings import strings
from .common import (
    EXIT_FAILED_CELLS,
    add_compile,
    add_device,
    add_drafter,
    add_dtype,
    add_fallback,
    add_unsafe_exec,
    code_execution,
)

COMMAND = "eval"


def add_parser(sub) -> None:
    from ..eval.evaluate import EvalConfig
    from ..settings import add_options

    ev = sub.add_parser(
        COMMAND,
        help="accuracy per task family and tokens per forward: a sweep over models and settings",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode an evaluation set with each model at each (block size, metric, tau) and score the "
        "answers.\n\n"
        "  * --tau applies to the prob and margin metrics (accept while confidence >= tau; 1 = one token per\n"
        "    forward). Entropy has another scale (accept while entropy <= tau, in nats; 0 = one token per\n"
        "    forward), so its thresholds come from --entropy-tau.\n"
        "  * An AR SFT checkpoint (marslm.json stage 'ar') is evaluated once, at tau=1: it is the baseline.\n"
        "  * One-token cells of a model are decoded once and shared by every block size and metric.\n"
        "  * With --json FILE every finished cell is saved at once; rerunning the same command skips them\n"
        "    (key: model, data, n, seed, tau, metric, block size, cache, mode, adaptive width, mask batch limit,\n"
        "    dtype, drafter).\n"
        '    A cell that fails (out of memory, say) is recorded as {"failed": reason}, the sweep goes on,\n'
        "    and a rerun retries it; the exit status is then 1.\n"
        "  * --draft-model: a separate AR drafter proposes K tokens per step and each model verifies them\n"
        "    (then, at tau < 1, adds its confident masks); rows decode one at a time, and tokens per forward\n"
        "    count the model's forwards (drafter_forwards: the drafter's).\n"
        '  * Report shape: one model gives {"model", "data", "results": [...]}; several give\n'
        '    {"models": [one such report per model]}.',
    )
    ev.add_argument(
        "--model",
        action="append",
        type=strings,
        required=True,
        metavar="DIR",
        help="checkpoint directory or hub id; repeat or comma-separate for several",
    )
    add_options(ev, EvalConfig)
    add_fallback(ev)
    add_compile(ev)
    add_dtype(ev)
    add_device(ev)
    add_drafter(ev)
    ev.add_argument("--markdown", metavar="FILE", help="also write the table as a markdown document")
    add_unsafe_exec(ev)
    ev.set_defaults(run=run)


def run(args) -> int:
    from ..decode.draft_options import DraftOptions
    from ..eval.evaluate import EvalConfig, data_key, model_reports, sweep
    from ..eval.report import format_markdown, format_table, labelled
    from ..files import output_file, write_text_atomically
    from ..settings import from_args

    if args.markdown:
        output_file(args.markdown, "--markdown")
    code_execution(args)
    models = [m for group in args.model for m in group]
    config = from_args(EvalConfig, args, models=models, drafting=from_args(DraftOptions, args))
    payload = sweep(config)
    reports = model_reports(payload)
    print(format_table(labelled(reports)))
    if args.markdown:
        write_text_atomically(args.markdown, format_markdown(model_reports(payload)))
    this_run = {(model, config.data, config.n, config.seed) for model in config.models}
    cells = [cell for rep in reports if data_key(rep) in this_run for cell in rep["results"]]
    failed = sum("failed" in cell for cell in cells)
    if failed:  # what succeeded is written; a rerun retries the rest
        print(f"marslm eval: {failed} of {len(cells)} cells failed (see the table)", file=sys.stderr)
        return EXIT_FAILED_CELLS
    return 0
