"""``marslm distill``: a model's own greedy answers to a prompt set, as chat JSONL to train MARS on."""

from __future__ import annotations

from ..errors import UserError
from .common import add_device

COMMAND = "distill"


def add_parser(sub) -> None:
    from ..distill import DEFAULT_BATCH, DEFAULT_PROMPTS

    dist = sub.add_parser(
        COMMAND,
        help="a model's own greedy answers to a prompt set, as chat JSONL to train MARS on",
        description="Decode every prompt greedily (marslm.generate at tau 1, batched, rows refilled as others "
        'finish) and append {"id", "messages": [..., assistant answer], ...} to OUTPUT as each answer is '
        "done. Rerunning resumes: ids already in OUTPUT are skipped. Answers cut by --max-new-tokens go to "
        "OUTPUT's .unfinished.jsonl twin instead (trained on, they would teach the model to stop there). "
        "`marslm train mars --data OUTPUT` trains on the result.",
    )
    dist.add_argument("--model", required=True, help="the model to distill (checkpoint directory or hub id)")
    dist.add_argument("--output", "-o", required=True, help="chat JSONL file to append to")
    dist.add_argument(
        "--prompts",
        default=DEFAULT_PROMPTS,
        help="comma-separated sources: instructions:N (generated everyday instructions), toy:N (the "
        f"toy suite), or a chat JSONL file (its turns before the first answer); default {DEFAULT_PROMPTS}",
    )
    dist.add_argument(
        "--split",
        choices=["train", "test"],
        default="train",
        help="which split of the generated sources (test: held-out prompts, for evaluation)",
    )
    dist.add_argument("--seed", type=int, default=0, help="seed of the generated sources")
    dist.add_argument("--max-new-tokens", type=int, default=128, help="longest answer (default 128)")
    dist.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH, help=f"rows decoded together (default {DEFAULT_BATCH})"
    )
    add_device(dist)
    dist.add_argument("--quiet", action="store_true", help="no progress bar")
    dist.set_defaults(run=run)


def run(args) -> int:
    from ..distill import check_output, distill, load_prompts
    from ..modeling import check_model_source, load_model, resolve_device

    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UserError("--max-new-tokens and --batch-size must be >= 1")
    check_output(args.output)
    prompts = load_prompts(args.prompts, args.split, seed=args.seed)
    check_model_source(args.model)
    model, tokenizer, _ = load_model(args.model, device=resolve_device(args.device))
    counts = distill(
        model,
        tokenizer,
        prompts,
        args.output,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        progress=not args.quiet,
    )
    print(
        f"{args.output}: {counts['done'] + counts['new']} of {len(prompts)} prompts answered "
        f"({counts['new']} now, {counts['unfinished']} of them cut at --max-new-tokens)"
    )
    return 0
