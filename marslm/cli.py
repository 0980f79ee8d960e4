"""The ``marslm`` command. Each subcommand is a thin shell over a library function.

Mistakes a user can fix (a bad path, a malformed file, a flag out of range) print one line to
stderr and exit with status 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .errors import UserError

EXIT_USAGE = 2


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="fine-tune a model: stage 'ar' (SFT) or 'mars' (the MARS objective)",
                           description="Fine-tune a Hugging Face causal LM on chat data. Stage 1 ('ar') is "
                           "ordinary SFT; stage 2 ('mars') continues from it with the two-stream MARS objective. "
                           "Runs unchanged under `accelerate launch` (multi-GPU, DeepSpeed, FSDP).")
    train.add_argument("stage", choices=["ar", "mars"], help="ar: next-token SFT; mars: MARS objective")
    train.add_argument("--model", required=True, help="hub id or local HF model directory to start from")
    train.add_argument("--data", required=True,
                       help="chat JSONL ({\"messages\": [...]} per line; loss on assistant turns) or 'toy'")
    train.add_argument("--output", "-o", required=True, help="directory for the finished checkpoint")
    train.add_argument("--block-size", type=int, default=4, help="MARS block size B (default 4)")
    train.add_argument("--ar-weight", type=float, default=1.0,
                       help="weight of the clean-stream (SFT) loss; 0 is the paper's ablation (default 1)")
    train.add_argument("--epochs", type=float, default=3.0, help="training epochs (default 3)")
    train.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    train.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (cosine, 3%% warmup)")
    train.add_argument("--warmup-ratio", type=float, default=0.03, help="warmup share of the steps")
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--batch-size", type=int, default=8, help="per-device batch size")
    train.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    train.add_argument("--max-length", type=int, default=1024, help="truncate longer sequences (with a warning)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU)")
    train.add_argument("--save-steps", type=int, default=500, help="checkpoint every N steps (for resuming)")
    train.add_argument("--logging-steps", type=int, default=10)
    train.add_argument("--data-n", type=int, default=None, help="examples to draw from a generated source (toy)")
    train.add_argument("--overwrite", action="store_true", help="replace an output directory that holds something")
    train.add_argument("--no-resume", action="store_true", help="ignore checkpoints left by an interrupted run")
    train.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_generate(sub) -> None:
    from .decode.acceptance import METRICS
    from .decode.batch import CACHE_MODES

    gen = sub.add_parser("generate", help="decode one prompt with the MARS sliding window",
                         description="Apply the chat template to PROMPT and decode it, accepting several "
                         "tokens per forward while the confidence passes tau (tau=1: plain greedy AR).")
    gen.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--tau", type=float, default=0.95, help="confidence threshold (1.0 = one token per forward)")
    gen.add_argument("--block-size", type=int, default=None, help="masks per step (default: the trained B)")
    gen.add_argument("--metric", choices=METRICS, default="prob", help="confidence metric (default prob)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--cache", choices=CACHE_MODES, default="cursor",
                     help="KV cache policy: cursor (default), block (the paper's) or none (recompute)")
    gen.add_argument("--block-cache-size", type=int, default=16, help="commit granularity of --cache block")
    gen.add_argument("--mode", choices=["threshold", "lossless"], default="threshold",
                     help="threshold: accept while confident (tau); lossless: masks draft, the next forward "
                     "verifies, output identical to greedy AR")
    gen.add_argument("--draft-groups", action="store_true",
                     help="lossless: one mask group per possible accepted-draft count")
    gen.add_argument("--use-last-mask", action="store_true",
                     help="also accept the last mask's prediction (B+1 candidates per step)")
    gen.add_argument("--no-chat-template", action="store_true", help="feed PROMPT as raw text")
    gen.add_argument("--json", action="store_true", help="print a JSON object instead of the text")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _add_eval(sub) -> None:
    from .decode.acceptance import METRICS
    from .decode.batch import CACHE_MODES

    ev = sub.add_parser("eval", help="accuracy per task family and tokens per forward, for each tau",
                        description="Decode an evaluation set with a model at each tau and score the answers.")
    ev.add_argument("--model", required=True, help="checkpoint directory (or hub id)")
    ev.add_argument("--data", default="toy", help="evaluation data (default: the toy suite's test split)")
    ev.add_argument("--tau", type=_floats, default=[1.0, 0.95, 0.9], help="comma-separated taus (default 1,0.95,0.9)")
    ev.add_argument("--metric", choices=METRICS, default="prob")
    ev.add_argument("--block-size", type=int, default=None, help="masks per step (default: the trained B)")
    ev.add_argument("--cache", choices=CACHE_MODES, default="cursor")
    ev.add_argument("--n", type=int, default=500, help="number of test items (default 500)")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--batch-size", type=int, default=32, help="rows decoded together")
    ev.add_argument("--max-new-tokens", type=int, default=192)
    ev.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_demo(sub) -> None:
    from .demo import PRESETS

    demo = sub.add_parser("demo", help="the whole method end to end on the embedded toy suite",
                          description="Build the toy suite and tokenizer, train a small Qwen2 from scratch (AR "
                          "SFT), fine-tune it with MARS, and compare both at several tau. Writes OUT/ar, "
                          "OUT/mars and OUT/report.json.")
    demo.add_argument("--out", default="runs/demo", help="output directory (replaced; default runs/demo)")
    demo.add_argument("--preset", choices=sorted(PRESETS), default="default",
                      help="quick: a smoke run in minutes; default: the quoted numbers, <= 15 min on 2 cores")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="wall-clock speed of MARS decoding modes against HF generate",
                           description="Decode the same test prompts with HF generate (AR and MARS checkpoints), "
                           "HF prompt-lookup decoding and each MARS mode, after a warm-up and over several "
                           "repeats; report tokens/s, tokens/forward, speed-up over AR, accuracy, peak KV.")
    bench.add_argument("--model", required=True, help="MARS checkpoint directory")
    bench.add_argument("--ar-model", required=True, help="AR SFT checkpoint directory (the baseline)")
    bench.add_argument("--data", default="toy")
    bench.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8])
    bench.add_argument("--n", type=int, default=32, help="prompts per contender and batch size")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--taus", type=_floats, default=[0.95, 0.9])
    bench.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    bench.add_argument("--quiet", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="marslm",
        description="MARS: fine-tune a Hugging Face causal LM to emit several tokens per forward pass, "
        "and decode with it.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_generate(sub)
    _add_eval(sub)
    _add_demo(sub)
    _add_bench(sub)
    return parser


def cmd_train(args) -> int:
    from .train import TrainConfig, train

    cfg = TrainConfig(stage=args.stage, model=args.model, data=args.data, output=args.output,
                      block_size=args.block_size, ar_weight=args.ar_weight, epochs=args.epochs,
                      max_steps=args.max_steps, learning_rate=args.lr, warmup_ratio=args.warmup_ratio,
                      weight_decay=args.weight_decay, batch_size=args.batch_size, grad_accum=args.grad_accum,
                      max_length=args.max_length, seed=args.seed, bf16=args.bf16, overwrite=args.overwrite,
                      resume=not args.no_resume, save_steps=args.save_steps, logging_steps=args.logging_steps,
                      data_n=args.data_n, progress=not args.quiet)
    summary = train(cfg)
    print(f"trained {summary.stage} -> {summary.output}: {summary.examples} examples "
          f"({summary.truncated} truncated, {summary.dropped} dropped), {summary.steps} steps, "
          f"final loss {summary.final_loss}, {summary.parameters:,} parameters, {summary.seconds}s")
    return 0


def cmd_generate(args) -> int:
    from .decode import check_tau, generate
    from .modeling import check_model_source, load_model

    check_tau(args.tau, args.metric)
    if args.block_size is not None and args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
    check_model_source(args.model)
    model, tokenizer, _ = load_model(args.model)
    result = generate(model, tokenizer, [args.prompt], tau=args.tau, block_size=args.block_size,
                      metric=args.metric, max_new_tokens=args.max_new_tokens,
                      apply_chat_template=not args.no_chat_template, cache=args.cache,
                      block_cache_size=args.block_cache_size, use_last_mask=args.use_last_mask,
                      mode=args.mode, draft_groups=args.draft_groups)
    if args.json:
        print(json.dumps({
            "text": result.texts[0],
            "tokens": len(result.token_ids[0]),
            "forwards": result.forwards[0],
            "tokens_per_forward": round(result.tokens_per_forward, 4),
            "accepted_per_step": result.accepted_per_step[0],
        }))
    else:
        print(result.texts[0])
    return 0


def cmd_eval(args) -> int:
    from .decode import check_tau
    from .evaluate import evaluate, format_table, load_eval_set
    from .modeling import check_model_source, load_model

    for tau in args.tau:
        check_tau(tau, args.metric)
    if args.n < 1:
        raise UserError(f"--n must be >= 1, got {args.n}")
    check_model_source(args.model)
    eval_set = load_eval_set(args.data, args.n, seed=args.seed)
    model, tokenizer, _ = load_model(args.model)
    report = evaluate(model, tokenizer, eval_set, taus=args.tau, metric=args.metric, block_size=args.block_size,
                      cache=args.cache, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                      progress=not args.quiet, model_name=args.model)
    print(format_table({args.model: report}))
    if args.json:
        _write_json(args.json, report)
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(args.out, args.preset, progress=not args.quiet)
    return 0


def cmd_bench(args) -> int:
    from .bench import default_contenders, format_bench_table, load_bench_models, run_bench
    from .evaluate import load_eval_set

    if args.n < 1 or args.repeats < 1 or not args.batch_sizes or min(args.batch_sizes) < 1:
        raise UserError("--n, --repeats and every --batch-sizes value must be >= 1")
    models = load_bench_models(args.model, args.ar_model)
    eval_set = load_eval_set(args.data, args.n)
    report = run_bench(models, eval_set, batch_sizes=args.batch_sizes, n=args.n, repeats=args.repeats,
                       max_new_tokens=args.max_new_tokens, contenders=default_contenders(taus=args.taus),
                       progress=not args.quiet)
    print(format_bench_table(report))
    if args.json:
        _write_json(args.json, report)
    return 0


def _write_json(path: str, payload: dict) -> None:
    from pathlib import Path

    try:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "eval": cmd_eval, "demo": cmd_demo, "bench": cmd_bench}


def _quiet_libraries() -> None:
    """Keep our progress bars; drop the per-file load/save bars and advisory warnings of the libraries."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="marslm: %(message)s")
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"marslm {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"marslm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
