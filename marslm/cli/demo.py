"""``marslm demo``: the whole method end to end, on the toy suite or on SmolLM2."""

from __future__ import annotations

from ..errors import UserError
from .common import add_unsafe_exec, code_execution

COMMAND = "demo"


def add_parser(sub) -> None:
    from ..demo.presets import DEMO_PRESETS
    from ..demo.smollm2_presets import SMOLLM2_PRESETS

    demo = sub.add_parser(
        COMMAND,
        help="the whole method end to end: the toy suite, or a real model (smollm2)",
        description="Toy presets: build the toy suite and tokenizer, train a small Qwen2 from "
        "scratch (AR SFT), fine-tune it with MARS and, as the fair baseline, continue the AR "
        "model with the same budget; compare at several tau; writes OUT/base, OUT/ar, OUT/ar_control, "
        "OUT/mars and OUT/report.json; OUT must be new or empty, or pass --overwrite. smollm2: convert "
        "SmolLM2-135M-Instruct, distill its own greedy answers, train MARS on them on the CPU, evaluate against the "
        "original model; every stage resumes (rerun the same command after an interruption).",
    )
    demo.add_argument(
        "--out", default=None, help="output directory (default runs/demo; runs/smollm2-demo for the smollm2 presets)"
    )
    demo.add_argument(
        "--preset",
        choices=sorted(DEMO_PRESETS) + sorted(SMOLLM2_PRESETS),
        default="default",
        help="quick: a smoke run in minutes; default: the quoted numbers; short: AR stopped half way up its "
        "learning curve (the ablation's setting); smollm2: MARS on SmolLM2-135M-Instruct in exact mode, the "
        "adapter on the attention's Linears, about 70 minutes on 2 cores (needs `make smollm2`'s packages); "
        "smollm2-quick: the same plumbing in a few minutes, no quality claims",
    )
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="toy presets: replace an earlier demo's output in OUT; only the entries a demo writes are "
        "deleted, anything else in OUT stays (the smollm2 presets resume instead)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    add_unsafe_exec(demo)
    demo.set_defaults(run=run)


def run(args) -> int:
    from ..demo.smollm2_presets import SMOLLM2_PRESETS
    from ..files import output_directory

    smollm2 = args.preset in SMOLLM2_PRESETS
    out = output_directory(args.out or ("runs/smollm2-demo" if smollm2 else "runs/demo"), "--out")
    if smollm2 and args.overwrite:
        raise UserError("--overwrite is for the toy presets; the smollm2 presets resume (a new --out starts over)")
    code_execution(args, check_now=True)  # both score the toy suite's code items
    if smollm2:
        from ..demo.smollm2 import run_smollm2_demo

        run_smollm2_demo(out, args.preset, progress=not args.quiet)
        return 0
    from ..demo.toy import run_demo

    run_demo(out, args.preset, overwrite=args.overwrite, progress=not args.quiet)
    return 0
