"""``marslm probe``: learning metrics of a MARS checkpoint on held-out references, teacher-forced."""

from __future__ import annotations

import argparse
import json

from .common import add_device, write_json

COMMAND = "probe"


def add_parser(sub) -> None:
    from ..eval.probe_report import DEFAULT_TAUS
    from ..settings import floats

    parser = sub.add_parser(
        COMMAND,
        help="is MARS learning? fidelity, per-mask accuracy and tokens per forward, teacher-forced",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run held-out answers through the model as training does (the clean stream and the masked "
        "stream, one batched forward, no decoding) and report, over answer tokens only:\n\n"
        "  * fidelity: the clean stream's top-1 agrees with the reference token (per prompt family too);\n"
        "  * per mask offset j (the j-th mask after a block's first answer position predicts the token j\n"
        "    places after the AR token): top-1 accuracy, held-out cross-entropy, the share with top-1\n"
        "    probability >= tau and the accuracy of those;\n"
        "  * tokens per forward, teacher-forced, with the paper's B candidates (the AR token and the first\n"
        "    B-1 masks): per block, 1 + the leading masks that pass the paper's rule (probability >= tau),\n"
        "    or that equal the clean stream's own top-1 (lossless: what self-drafting keeps).\n\n"
        "DATA is a chat JSONL file; a `marslm distill` output's answer_ids (the original model's greedy\n"
        "tokens) are the references, else each record's first assistant turn. Block size and mask token\n"
        "come from the checkpoint. Estimates: every block sees the reference before it; `marslm eval`\n"
        "measures decoding itself.",
    )
    parser.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    parser.add_argument("--data", required=True, metavar="JSONL", help="held-out records (a distill output)")
    parser.add_argument(
        "--tau",
        type=floats,
        nargs="+",
        default=[list(DEFAULT_TAUS)],
        help="comma-separated confidence thresholds, top-1 probability in (0, 1], as eval's --tau "
        f"(space-separated ones are taken too) (default {','.join(map(str, DEFAULT_TAUS))})",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="items per forward (default 8)")
    parser.add_argument("--limit", type=int, help="probe only the first N items")
    parser.add_argument(
        "--original",
        metavar="DIR",
        help="also run the untouched original in bf16 (autocast) on the same items: its top-1 agreement with "
        "the references is how much bf16 rounding alone moves greedy choices, the baseline for fidelity",
    )
    add_device(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON (no progress bar)")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    parser.set_defaults(run=run)


def run(args) -> int:
    import logging

    from ..eval.probe import probe, probe_clean
    from ..eval.probe_items import load_probe_items
    from ..eval.probe_report import format_probe
    from ..modeling import checkpoint_facts, load_model, model_context, resolve_device

    _check(args)
    device = resolve_device(args.device)
    model, tokenizer, _ = load_model(args.model, device=device)
    facts = checkpoint_facts(model, tokenizer)
    items = load_probe_items(args.data, tokenizer, args.limit, model_context(model))
    progress = not args.json
    report = {"model": args.model, "data": args.data, "mask_token_id": facts.mask_token_id}
    if facts.mask_token_id is None:
        logging.getLogger("marslm").warning(
            "%s has no mask token (<|mask|>): fidelity only, from the clean stream", args.model
        )
        report.update(probe_clean(model, items, pad_id=facts.pad_id, batch_size=args.batch_size, progress=progress))
    else:
        if facts.stage != "mars":
            logging.getLogger("marslm").warning(
                "%s is not a MARS checkpoint (marslm.json stage %r): its masks were never trained; block size %d "
                "assumed",
                args.model,
                facts.stage,
                facts.block_size,
            )
        report.update(
            probe(
                model,
                items,
                block_size=facts.block_size,
                mask_token_id=facts.mask_token_id,
                taus=tuple(args.tau),
                pad_id=facts.pad_id,
                batch_size=args.batch_size,
                progress=progress,
            )
        )
    if args.original:
        del model
        report["original_bf16"] = _probe_original(args, device, progress)
    if args.out:
        write_json(args.out, report)
    print(json.dumps(report, indent=2) if args.json else f"probe {args.model} on {args.data}\n{format_probe(report)}")
    return 0


def _check(args) -> None:
    from ..decode.params import check_tau
    from ..errors import UserError
    from ..files import output_file
    from ..modeling import check_model_source

    if args.out:
        output_file(args.out, "--out")
    args.tau = [tau for group in args.tau for tau in group]  # --tau 0.8,0.9 and --tau 0.8 0.9 alike
    if not args.tau:
        raise UserError("--tau needs at least one threshold")
    for tau in args.tau:
        check_tau(tau, "prob")
    for flag, value in (("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    check_model_source(args.model)
    if args.original:
        check_model_source(args.original)


def _probe_original(args, device, progress: bool) -> dict:
    import torch

    from ..eval.probe import probe_clean
    from ..eval.probe_items import load_probe_items
    from ..modeling import checkpoint_facts, load_model, model_context

    original, original_tokenizer, _ = load_model(args.original, dtype="float32", device=device)
    return {
        "model": args.original,
        **probe_clean(
            original,
            load_probe_items(args.data, original_tokenizer, args.limit, model_context(original)),
            pad_id=checkpoint_facts(original, original_tokenizer).pad_id,
            batch_size=args.batch_size,
            autocast_dtype=torch.bfloat16,
            progress=progress,
        ),
    }
