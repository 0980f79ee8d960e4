"""``marslm bench``: wall-clock decoding speed against HF generate, or the cost of fed width."""

from __future__ import annotations

from ..errors import UserError
from .common import add_device, add_unsafe_exec, code_execution, floats, ints, strings, write_json

COMMAND = "bench"


def add_parser(sub) -> None:
    from ..experiments.bench import CONTENDER_GROUPS
    from ..experiments.train_step import SHAPES

    bench = sub.add_parser(
        COMMAND,
        help="wall-clock speed of MARS decoding modes against HF generate",
        description="Decode the same test prompts with HF generate (AR and MARS checkpoints), "
        "HF prompt-lookup decoding and each MARS mode, after a warm-up and over several "
        "repeats taken in turn; report tokens/s, tokens/forward, speed-up over AR, accuracy, "
        "peak KV. With --cost-curve: instead, the time of one cached forward of the --model "
        "against the number of tokens it feeds (w = 1 .. 2B + 2), as ratios to w = 1, which "
        "tells whether MARS can pay on this machine. With --train-step: instead, the time and "
        "peak memory of a MARS training step against an AR (SFT) step, per sequence length.",
    )
    bench.add_argument("--model", help="MARS checkpoint directory (with --train-step: any checkpoint, or use --shape)")
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
    train_step = bench.add_argument_group("--train-step: what MARS training costs against SFT")
    train_step.add_argument(
        "--train-step", action="store_true", help="time a MARS training step against an AR step instead of decoding"
    )
    train_step.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="a named model shape with random weights instead of --model (no download)",
    )
    train_step.add_argument("--layers", type=int, help="--shape: keep only this many decoder layers")
    train_step.add_argument("--seq-lens", type=ints, default=[256, 512], help="tokens per row (default 256,512)")
    train_step.add_argument("--prompt-share", type=float, default=0.3, help="untrained share of each row (default 0.3)")
    train_step.add_argument(
        "--logits",
        choices=("targets", "full", "both"),
        default="targets",
        help="targets: the fused target-only head training uses; full: full logits at every column; both",
    )
    train_step.add_argument("--attention", choices=("sdpa", "eager", "flex"), default="sdpa")
    train_step.add_argument("--gradient-checkpointing", action="store_true")
    train_step.add_argument("--bf16", action="store_true", help="bf16 autocast (on CUDA, as training's default)")
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
    if args.train_step:
        return _train_step(args)
    if args.model is None:
        raise UserError("--model is required")
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
    from ..modeling import check_model_source, checkpoint_block_size, load_model, model_context, resolve_device

    if not args.contexts or min(args.contexts) < 1 or (args.block_size is not None and args.block_size < 1):
        raise UserError("every --contexts value and --block-size must be >= 1")
    check_model_source(args.model)
    widths = list(range(1, 2 * (args.block_size or checkpoint_block_size(args.model)) + 3))
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


def _train_step(args) -> int:
    from ..config import MarsConfig
    from ..experiments.train_step import build_shape, format_train_step, train_step_bench
    from ..modeling import check_model_source, checkpoint_block_size, enable_activation_checkpointing, resolve_device

    if (args.model is None) == (args.shape is None):
        raise UserError("--train-step needs exactly one of --model or --shape")
    if not args.seq_lens or min(args.seq_lens) < 2:
        raise UserError("every --seq-lens value must be >= 2")
    if not 0 <= args.prompt_share < 1:
        raise UserError(f"--prompt-share must be in [0, 1), got {args.prompt_share}")
    if args.block_size is not None and args.block_size < 1:
        raise UserError("--block-size must be >= 1")
    device = resolve_device(args.device) or "cpu"
    attention = "flex_attention" if args.attention == "flex" else args.attention
    if attention == "flex_attention" and not str(device).startswith("cuda"):
        raise UserError("--attention flex needs CUDA (torch has no FlexAttention backward on a CPU)")
    if args.shape:
        model = build_shape(args.shape, args.layers, attention, device=device)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        from ..modeling import loading_errors

        check_model_source(args.model)
        with loading_errors(args.model):
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attention)
        model.to(device)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model)
    logits = {"targets": (True,), "full": (False,), "both": (True, False)}[args.logits]
    report = train_step_bench(
        model,
        seq_lens=args.seq_lens,
        batch_size=args.batch_sizes[0],  # rows per step: the first --batch-sizes value
        prompt_share=args.prompt_share,
        block_size=args.block_size or (checkpoint_block_size(args.model) if args.model else MarsConfig().block_size),
        repeats=args.repeats,
        target_logits=logits,
        bf16=args.bf16,
        progress=not args.quiet,
    )
    print(format_train_step(report))
    if args.json:
        write_json(args.json, report)
    return 0
