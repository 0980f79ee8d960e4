"""``marslm bench``: wall-clock decoding speed against HF generate, or the cost of fed width."""

from __future__ import annotations

from ..errors import UserError
from .common import add_device, add_unsafe_exec, code_execution, floats, ints, strings, write_json

COMMAND = "bench"


def add_parser(sub) -> None:
    from ..experiments.bench import CONTENDER_GROUPS

    bench = sub.add_parser(
        COMMAND,
        help="wall-clock speed of MARS decoding modes against HF generate",
        description="Decode the same test prompts with HF generate (AR and MARS checkpoints), "
        "HF prompt-lookup decoding and each MARS mode, after a warm-up and over several "
        "repeats taken in turn; report tokens/s, tokens/forward, speed-up over AR, accuracy, "
        "peak KV. With --cost-curve: instead, the time of one cached forward of the --model "
        "against the number of tokens it feeds (w = 1 .. 2B + 2), as ratios to w = 1, which "
        "tells whether MARS can pay on this machine.",
    )
    bench.add_argument("--model", required=True, help="MARS checkpoint directory")
    bench.add_argument(
        "--ar-model",
        default=None,
        help="AR checkpoint directory, the baseline (HF generate with KV cache); required unless "
        "--cost-curve. For a pretrained model fine-tuned with MARS: the original model",
    )
    bench.add_argument(
        "--data",
        type=strings,
        default=["toy"],
        help="comma-separated evaluation sets, each benchmarked in turn (default toy; 'reworded' is "
        "the off-distribution set)",
    )
    bench.add_argument("--batch-sizes", type=ints, default=[1, 4, 8])
    bench.add_argument("--n", type=int, default=32, help="prompts per contender and batch size")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--taus", type=floats, default=[0.95, 0.9])
    bench.add_argument(
        "--contenders",
        type=strings,
        default=list(CONTENDER_GROUPS),
        help=f"comma-separated contender groups besides HF generate on --ar-model (always run): "
        f"{', '.join(CONTENDER_GROUPS)} (default all)",
    )
    bench.add_argument(
        "--cost-curve", action="store_true", help="measure forward time against fed width instead of decoding"
    )
    bench.add_argument("--contexts", type=ints, default=[128, 512], help="--cost-curve: cached context lengths")
    bench.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="--cost-curve: B, for widths 1 .. 2B + 2 (default: the checkpoint's, else 4)",
    )
    add_device(bench)
    bench.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    bench.add_argument("--quiet", action="store_true")
    add_unsafe_exec(bench)
    bench.set_defaults(run=run)


def run(args) -> int:
    from ..decode import check_tau
    from ..evaluate import load_eval_set
    from ..experiments.bench import default_contenders, format_bench_table, load_bench_models, run_bench

    code_execution(args)
    if args.n < 1 or args.repeats < 1 or not args.batch_sizes or min(args.batch_sizes) < 1:
        raise UserError("--n, --repeats and every --batch-sizes value must be >= 1")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for tau in args.taus:
        check_tau(tau, "prob")
    if args.cost_curve:
        return _cost_curve(args)
    if args.ar_model is None:
        raise UserError("--ar-model is required: the AR baseline is HF generate on the AR checkpoint")
    contenders = default_contenders(taus=args.taus, groups=args.contenders)
    eval_sets = [load_eval_set(name, args.n) for name in args.data]
    models = load_bench_models(args.model, args.ar_model, device=args.device)
    reports = {}
    for eval_set in eval_sets:
        reports[eval_set.name] = run_bench(
            models,
            eval_set,
            batch_sizes=args.batch_sizes,
            n=args.n,
            repeats=args.repeats,
            max_new_tokens=args.max_new_tokens,
            contenders=contenders,
            progress=not args.quiet,
        )
        print(f"== {eval_set.name} ==\n{format_bench_table(reports[eval_set.name])}")
    if args.json:
        write_json(args.json, reports if len(reports) > 1 else next(iter(reports.values())))
    return 0


def _cost_curve(args) -> int:
    from ..decode.costs import cost_curve
    from ..experiments.bench import format_cost_curve
    from ..modeling import check_model_source, load_model, model_context, resolve_device, trained_block_size

    if not args.contexts or min(args.contexts) < 1 or (args.block_size is not None and args.block_size < 1):
        raise UserError("every --contexts value and --block-size must be >= 1")
    check_model_source(args.model)
    widths = list(range(1, 2 * (args.block_size or trained_block_size(args.model)) + 3))
    room = model_context(args.model)
    if room is not None and max(args.contexts) + widths[-1] > room:
        raise UserError(
            f"--contexts {max(args.contexts)} plus the widest step fed on top ({widths[-1]} tokens) exceeds "
            f"the model's context of {room} tokens"
        )
    model, _, _ = load_model(args.model, device=resolve_device(args.device))
    report = cost_curve(
        model,
        widths=widths,
        contexts=args.contexts,
        batch_sizes=args.batch_sizes,
        repeats=args.repeats,
        progress=not args.quiet,
    )
    print(format_cost_curve(report))
    if args.json:
        write_json(args.json, report)
    return 0
