"""``marslm generate``: decode one prompt; its decoding options are ``DecodingParams``'s fields."""

from __future__ import annotations

import json

from .common import FALLBACK_OPTIONS, add_compile, add_device, add_drafter, add_dtype, add_fallback

COMMAND = "generate"


def add_parser(sub) -> None:
    from ..decode.params import DecoderOptions, DecodingParams
    from ..settings import add_options

    parser = sub.add_parser(
        COMMAND,
        help="decode one prompt with the MARS sliding window",
        description="Apply the chat template to PROMPT and decode it, accepting several "
        "tokens per forward while the confidence passes tau (tau=1: plain greedy AR).",
    )
    parser.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    parser.add_argument("--prompt", required=True, help="the user message")
    add_options(parser, DecodingParams, defaults={"tau": 0.95})
    decoder = parser.add_argument_group("decoder")
    add_options(decoder, DecoderOptions, skip=FALLBACK_OPTIONS)
    add_fallback(decoder)
    add_compile(decoder)
    add_device(decoder)
    add_dtype(decoder)
    add_drafter(decoder)
    parser.add_argument("--no-chat-template", action="store_true", help="feed PROMPT as raw text")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..decode import generate
    from ..decode.params import DecoderOptions, DecodingParams
    from ..settings import from_args
    from .common import load_drafter, load_for_decoding

    decoder, params = from_args(DecoderOptions, args), from_args(DecodingParams, args)
    if args.draft_model is not None:
        from ..decode.draft_model import check_draft_settings

        check_draft_settings(params, decoder)  # before either model loads
    drafting = load_drafter(args)
    model, tokenizer, params = load_for_decoding(args.model, params, args.device, decoder, args.dtype)
    result = generate(
        model, tokenizer, [args.prompt], params, decoder, apply_chat_template=not args.no_chat_template, **drafting
    )
    if args.json:
        report = {
            "text": result.texts[0],
            "tokens": len(result.token_ids[0]),
            "forwards": result.forwards[0],
            "tokens_per_forward": round(result.tokens_per_forward, 4),
            "accepted_per_step": result.accepted_per_step[0],
            # what it decoded with, so that a number quoted from here carries its settings
            "settings": {
                "mode": params.mode,
                "tau": params.tau,
                "block_size": params.block_size,
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "compiled": result.stats.compiled,
                "graphs": result.stats.graphs,
                "cost_table": result.stats.cost_table,
            },
        }
        if drafting:  # the target's forwards above; the drafter's beside them
            report["drafter_forwards"] = result.stats.drafter_forwards
        print(json.dumps(report))
    else:
        print(result.texts[0])
    return 0
