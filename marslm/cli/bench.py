"""``marslm bench``: wall-clock decoding speed against HF generate, or the cost of fed width."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UserError
from .common import (
    add_compile,
    add_device,
    add_drafter,
    add_fallback,
    add_unsafe_exec,
    allocation_errors,
    code_execution,
    write_json,
)

if TYPE_CHECKING:
    from ..bench.config import BenchConfig

COMMAND = "bench"


def add_parser(sub) -> None:
    from dataclasses import fields

    from ..bench.config import TRAIN_STEP_FIELDS, BenchConfig
    from ..settings import add_options

    bench = sub.add_parser(
        COMMAND,
        help="wall-clock speed of MARS decoding modes against HF generate",
        description="Decode the same test prompts with HF generate (AR and MARS checkpoints), "
        "HF prompt-lookup decoding and each MARS mode, after a warm-up and over several "
        "repeats taken in turn; report tokens/s, tokens/forward, speed-up over AR, accuracy, "
        "peak KV. With --draft-model, also a separate AR drafter verified by each checkpoint "
        "(marslm's; on the MARS one with its masks under tau, the paper's section 4.6) and HF assisted "
        "generation with it; their tokens/forward count the target's forwards, and the drafter's are "
        "counted beside them. With --cost-curve: instead, the time of one cached forward of the --model "
        "against the number of tokens it feeds (w = 1 .. 2B + 2), as ratios to w = 1, which "
        "tells whether MARS can pay on this machine. With --train-step: instead, the time and "
        "peak memory of a MARS training step against an AR (SFT) step, per sequence length.",
    )
    add_options(bench, BenchConfig, skip=TRAIN_STEP_FIELDS)
    train_step = bench.add_argument_group("--train-step: what MARS training costs against SFT")
    others = tuple(f.name for f in fields(BenchConfig) if f.name not in TRAIN_STEP_FIELDS)
    add_options(train_step, BenchConfig, skip=others)
    add_device(bench)
    fallback = "where masks do not pay: every MARS contender but the block cache's (cursor-adaptive, -auto: their own)"
    add_fallback(bench.add_argument_group(fallback))
    add_compile(bench)
    add_drafter(bench.add_argument_group("a separate drafter: the draft, draft-ar and assisted contender groups"))
    add_unsafe_exec(bench)
    bench.set_defaults(run=run)


def run(args) -> int:
    from ..bench.config import BenchConfig
    from ..bench.report import format_bench_table
    from ..bench.speed import load_bench_models, run_bench
    from ..decode.draft_options import DraftOptions
    from ..eval.sets import load_eval_set
    from ..settings import from_args

    code_execution(args)
    config = from_args(BenchConfig, args, drafting=from_args(DraftOptions, args))
    if config.train_step:
        return _train_step(config)
    if config.cost_curve:
        return _cost_curve(config)
    eval_sets = [load_eval_set(name, config.n) for name in config.data]
    models = load_bench_models(config)
    reports = {}
    for eval_set in eval_sets:
        reports[eval_set.name] = run_bench(models, eval_set, config)
        print(f"== {eval_set.name} ==\n{format_bench_table(reports[eval_set.name])}")
    if config.json_path:
        write_json(config.json_path, reports if len(reports) > 1 else next(iter(reports.values())))
    return 0


def _cost_curve(config: BenchConfig) -> int:
    from ..bench.report import format_against_eager, format_cost_curve, format_profile
    from ..decode.cost_curve import cost_curve
    from ..modeling import check_model_source, checkpoint_block_size, load_model, model_context, resolve_device

    check_model_source(config.model)
    block_size = config.block_size or checkpoint_block_size(config.model)
    widest = 2 * block_size + 2
    room = model_context(config.model)
    if room is not None and max(config.contexts) + widest > room:
        raise UserError(
            f"--contexts {max(config.contexts)} plus the widest step fed on top ({widest} tokens: "
            f"2 --block-size + 2) exceeds the model's context of {room} tokens"
        )
    model, _, _ = load_model(config.model, dtype=config.dtype, device=resolve_device(config.device))
    from ..decode.compile_policy import resolve_compile
    from ..decode.forward import WIDTHS

    # compiled, each width is a graph of its own: the widths a compiled decoder pads its steps to
    ways = (False, True) if config.compile is True else (resolve_compile(config.compile, "cursor", model.device),)
    widths = [w for w in range(1, widest + 1) if not ways[-1] or w in WIDTHS]
    curves = []
    with allocation_errors("--batch-sizes or --contexts"):
        for compiled in ways:
            curve = cost_curve(
                model,
                widths=widths,
                contexts=config.contexts,
                batch_sizes=config.batch_sizes,
                repeats=config.repeats,
                progress=config.progress,
                compile=compiled,
                profile=(1, block_size + 1) if config.profile else (),
            )
            curves.append(curve)
            print(format_cost_curve(curve) + "\n")
            if "profile" in curve:
                print(format_profile(curve) + "\n")
    if len(curves) == 2:
        print(format_against_eager(*curves))
    report = curves[-1]  # the step the decoder runs with these settings: its table is the one saved
    if config.save:
        from ..decode.costs import save_cost_table, table_from_curve

        path = save_cost_table(config.model, table_from_curve(report, block_size))
        print(f"cost table for block size {block_size}: {path}")
    if config.json_path:
        write_json(config.json_path, report if len(curves) == 1 else {"eager": curves[0], "compiled": curves[1]})
    return 0


def _train_step(config: BenchConfig) -> int:
    from ..bench.train_step import build_shape, format_train_step, train_step_bench
    from ..mars_json import MarsConfig
    from ..modeling import check_model_source, checkpoint_block_size, resolve_device
    from ..training.surgery import enable_activation_checkpointing

    device = resolve_device(config.device) or "cpu"
    attention = "flex_attention" if config.attention == "flex" else config.attention
    if attention == "flex_attention" and not str(device).startswith("cuda"):
        raise UserError("--attention flex needs CUDA (torch has no FlexAttention backward on a CPU)")
    if config.shape:
        model = build_shape(config.shape, config.layers, attention, device=device)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        from ..modeling import loading_errors

        check_model_source(config.model)
        with loading_errors(config.model):
            model = AutoModelForCausalLM.from_pretrained(
                config.model, dtype=torch.float32, attn_implementation=attention
            )
        model.to(device)
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    logits = {"targets": (True,), "full": (False,), "both": (True, False)}[config.logits]
    block_size = config.block_size or (checkpoint_block_size(config.model) if config.model else MarsConfig().block_size)
    with allocation_errors("--batch-sizes or --seq-lens"):
        report = train_step_bench(
            model,
            seq_lens=config.seq_lens,
            batch_size=config.batch_sizes[0],  # rows per step: the first --batch-sizes value
            prompt_share=config.prompt_share,
            block_size=block_size,
            repeats=config.repeats,
            target_logits=logits,
            bf16=config.bf16,
            progress=config.progress,
        )
    print(format_train_step(report))
    if config.json_path:
        write_json(config.json_path, report)
    return 0
