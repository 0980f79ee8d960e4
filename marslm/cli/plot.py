"""``marslm plot``: the accuracy / tokens-per-forward frontier from eval reports."""

from __future__ import annotations

COMMAND = "plot"


def add_parser(sub) -> None:
    from ..eval.plots import IMAGE_NAME

    plot = sub.add_parser(
        COMMAND,
        help="accuracy vs tokens/forward frontier from eval reports (PNG)",
        description="Draw accuracy against tokens per forward, one panel per task family plus 'overall', one "
        "curve per (model, block size, metric) joining its Pareto-optimal taus. Reads eval reports, sweep "
        "reports and the demo's report.json. The AR SFT baseline is a dotted line: the models of --baseline "
        "(a report file or a model label), else any stage-'ar' checkpoint or model with only tau=1 results.",
    )
    plot.add_argument("reports", nargs="+", metavar="REPORT", help="JSON report(s) written by marslm")
    plot.add_argument(
        "--out",
        "-o",
        default=IMAGE_NAME,
        help=f"image to write: PNG unless its suffix names another format (.svg, .pdf); a name without "
        f"suffix gets .png; an existing directory gets {IMAGE_NAME} inside (default {IMAGE_NAME})",
    )
    plot.add_argument(
        "--baseline",
        action="append",
        metavar="REPORT_OR_LABEL",
        help="the AR baseline: a report file or the label of a model in REPORT (repeatable)",
    )
    plot.add_argument("--title", help="figure title (default: names the data)")
    plot.set_defaults(run=run)


def run(args) -> int:
    from ..eval.plots import load_series, plot_frontier

    out = plot_frontier(load_series(args.reports, args.baseline), args.out, title=args.title)
    print(f"wrote {out}")
    return 0
