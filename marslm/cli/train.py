"""``marslm train ar|mars``: one training stage; its options are ``TrainConfig``'s fields."""

from __future__ import annotations

import sys

COMMAND = "train"


def add_parser(sub) -> None:
    from ..settings import add_options
    from ..training.config import TrainConfig

    parser = sub.add_parser(
        COMMAND,
        help="fine-tune a model: stage 'ar' (SFT) or 'mars' (the MARS objective)",
        description="Fine-tune a Hugging Face causal LM on chat data. Stage 1 ('ar') is "
        "ordinary SFT; stage 2 ('mars') continues from it with the two-stream MARS objective. "
        "Runs unchanged under `accelerate launch` (multi-GPU, DeepSpeed, FSDP).",
    )
    add_options(parser, TrainConfig, positional=("stage",))
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..settings import from_args
    from ..training.config import TrainConfig
    from ..training.recipe import train

    summary = train(from_args(TrainConfig, args))
    _end_distributed()
    # One write per line: under `accelerate launch` every rank prints its summary to the same
    # pipe, and print()'s separate write of the newline lets two ranks' lines run together.
    sys.stdout.write(
        f"trained {summary.stage} -> {summary.output}: {summary.examples} examples "
        f"({summary.truncated} truncated, {summary.dropped} dropped), {summary.steps} steps, "
        f"final loss {summary.final_loss}, {summary.parameters:,} parameters, {summary.seconds}s\n"
    )
    sys.stdout.flush()
    return 0


def _end_distributed() -> None:
    """Under `accelerate launch`, leave the process group cleanly: torch asks for it, and a rank
    that exits with gloo's threads still running can abort ("terminate called without an active
    exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
