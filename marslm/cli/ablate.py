"""``marslm ablate``: the paper's comparison set on the toy suite."""

from __future__ import annotations

import argparse

from ..settings import ints
from .common import add_unsafe_exec, code_execution

COMMAND = "ablate"


def add_parser(sub) -> None:
    from ..demo.presets import DEMO_PRESETS

    ablate = sub.add_parser(
        COMMAND,
        help="the paper's comparison set (AR, compute-matched AR, MARS w=1/0 x B, Jacobi) on the toy suite",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and evaluate the paper's comparison set (Tables 2-3) on the embedded toy suite,\n"
        "from the demo's from-scratch Qwen2 (N = the preset's AR steps):\n"
        "  AR N            AR SFT for N steps (the control)\n"
        "  AR 2N           AR N continued for N more steps: compute-matched AR\n"
        "  MARS B=b w=1    MARS from AR N at each block size b, with the AR loss term\n"
        "  MARS B=b w=0    the same without it (the paper's 'MARS w/o SFT loss', masked loss weighted 1/t)\n"
        "  Jacobi (AR N)   training-free Jacobi decoding of AR N (window 4)\n"
        "AR rows are evaluated at tau 1, MARS rows at tau 1, 0.95, 0.9, 0.8. Writes OUT/<config>/ checkpoints,\n"
        "OUT/ablation.json (readable by 'marslm plot'), OUT/ablation.md and OUT/frontier.png. Resumable: rerun\n"
        "with the same --out and finished configurations are skipped. The quick preset takes a few minutes;\n"
        "the others about an hour on 2 CPU cores (docs/results.md).",
    )
    ablate.add_argument(
        "--preset",
        choices=sorted(DEMO_PRESETS),
        default="default",
        help="quick: a smoke run; default: the demo's setting; short: AR N half way up the AR learning curve",
    )
    ablate.add_argument(
        "--out", default="runs/ablate", help="output directory, resumed if it exists (default runs/ablate)"
    )
    ablate.add_argument("--block-sizes", type=ints, default=[4, 8, 16], help="MARS block sizes (default 4,8,16)")
    ablate.add_argument("--quiet", action="store_true", help="no progress bars")
    add_unsafe_exec(ablate)
    ablate.set_defaults(run=run)


def run(args) -> int:
    from ..demo.ablate import run_ablation

    code_execution(args, check_now=True)
    run_ablation(args.out, args.preset, block_sizes=args.block_sizes, progress=not args.quiet)
    return 0
