"""``marslm eval``: accuracy and tokens per forward, a resumable sweep over models and settings."""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from .common import (
    EXIT_FAILED_CELLS,
    add_adaptive_width,
    add_device,
    add_unsafe_exec,
    code_execution,
    floats,
    ints,
    strings,
)

COMMAND = "eval"


def add_parser(sub) -> None:
    from ..decode.params import CACHE_MODES, METRICS, MODES
    from ..evaluate import ENTROPY_TAUS, EVAL_SOURCES

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
        "    (key: model, data, n, seed, tau, metric, block size, cache, mode, adaptive width). A cell that\n"
        '    fails (out of memory, say) is recorded as {"failed": reason}, the sweep goes on, and a rerun\n'
        "    retries it; the exit status is then 1.\n"
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
    ev.add_argument("--data", default="toy", help=f"evaluation data: {EVAL_SOURCES} (default toy)")
    ev.add_argument(
        "--tau",
        type=floats,
        default=[1.0, 0.95, 0.9],
        help="comma-separated taus for the prob and margin metrics (default 1,0.95,0.9)",
    )
    ev.add_argument(
        "--entropy-tau",
        type=floats,
        default=list(ENTROPY_TAUS),
        help="comma-separated entropy thresholds in nats for --metric entropy "
        f"(default {','.join(f'{t:g}' for t in ENTROPY_TAUS)})",
    )
    ev.add_argument(
        "--metric",
        type=strings,
        default=["prob"],
        help=f"comma-separated confidence metrics from {','.join(METRICS)} (default prob)",
    )
    ev.add_argument(
        "--block-size",
        type=ints,
        default=None,
        help="comma-separated block sizes (masks per step; default: each checkpoint's trained B)",
    )
    ev.add_argument("--cache", choices=CACHE_MODES, default="cursor")
    ev.add_argument(
        "--mode",
        choices=MODES,
        default="threshold",
        help="threshold: MARS acceptance by tau; lossless: exact greedy output, tau ignored",
    )
    add_adaptive_width(ev)
    ev.add_argument("--n", type=int, default=500, help="number of test items (default 500)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the toy suite's test items")
    ev.add_argument("--batch-size", type=int, default=32, help="rows decoded together")
    ev.add_argument("--max-new-tokens", type=int, default=192)
    add_device(ev)
    ev.add_argument("--json", metavar="FILE", help="write the report to FILE after every cell; resume from it")
    ev.add_argument("--markdown", metavar="FILE", help="also write the table as a markdown document")
    ev.add_argument("--no-resume", action="store_true", help="with --json: start afresh, replacing FILE")
    ev.add_argument("--quiet", action="store_true", help="no progress bars or per-cell lines")
    add_unsafe_exec(ev)
    ev.set_defaults(run=run)


def run(args) -> int:
    from ..decode.params import METRICS
    from ..evaluate import data_key, format_markdown, format_table, labelled, model_reports, sweep
    from ..files import write_text_atomically

    code_execution(args)
    models = [m for group in args.model for m in group]
    for metric in args.metric:
        if metric not in METRICS:
            raise UserError(f"unknown metric {metric!r} in --metric; choose from {', '.join(METRICS)}")
    if not models or not args.tau or not args.metric or (args.block_size is not None and not args.block_size):
        raise UserError("--model, --tau, --metric and --block-size need at least one value each")
    if args.n < 1:
        raise UserError(f"--n must be >= 1, got {args.n}")
    payload = sweep(
        models,
        args.data,
        n=args.n,
        seed=args.seed,
        taus=args.tau,
        entropy_taus=args.entropy_tau,
        metrics=args.metric,
        block_sizes=args.block_size,
        cache=args.cache,
        mode=args.mode,
        adaptive_width=args.adaptive_width,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        json_path=args.json,
        resume=not args.no_resume,
        progress=not args.quiet,
        device=args.device,
    )
    reports = model_reports(payload)
    print(format_table(labelled(reports)))
    if args.markdown:
        write_text_atomically(args.markdown, format_markdown(payload))
    this_run = {(model, args.data, args.n, args.seed) for model in models}
    cells = [cell for rep in reports if data_key(rep) in this_run for cell in rep["results"]]
    failed = sum("failed" in cell for cell in cells)
    if failed:  # what succeeded is written; a rerun retries the rest
        print(f"marslm eval: {failed} of {len(cells)} cells failed (see the table)", file=sys.stderr)
        return EXIT_FAILED_CELLS
    return 0
