"""``marslm generate``: decode one prompt; its decoding options are ``DecodingParams``'s fields."""

from __future__ import annotations

import json

from .common import add_adaptive_width, add_device

COMMAND = "generate"


def add_parser(sub) -> None:
    from ..decode.params import CACHE_MODES, DecodingParams
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
    decoder.add_argument(
        "--cache",
        choices=CACHE_MODES,
        default="cursor",
        help="KV cache policy: cursor (default), block (the paper's) or none (recompute)",
    )
    decoder.add_argument("--block-cache-size", type=int, default=16, help="positions per block of --cache block")
    decoder.add_argument(
        "--draft-groups", action="store_true", help="lossless: one mask group per possible accepted-draft count"
    )
    decoder.add_argument(
        "--no-last-mask",
        dest="use_last_mask",
        action="store_false",
        help="ignore the last mask's prediction (the authors' sampler; default: use it, B+1 candidates per step)",
    )
    add_adaptive_width(decoder)
    add_device(decoder)
    parser.add_argument("--no-chat-template", action="store_true", help="feed PROMPT as raw text")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..decode import generate
    from ..decode.params import DecodingParams
    from ..settings import from_args
    from .common import load_for_decoding

    model, tokenizer, params = load_for_decoding(args.model, from_args(DecodingParams, args), args.device)
    result = generate(
        model,
        tokenizer,
        [args.prompt],
        tau=params.tau,
        block_size=params.block_size,
        metric=params.metric,
        max_new_tokens=params.max_new_tokens,
        mode=params.mode,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=params.stop,
        apply_chat_template=not args.no_chat_template,
        cache=args.cache,
        block_cache_size=args.block_cache_size,
        use_last_mask=args.use_last_mask,
        draft_groups=args.draft_groups,
        adaptive_width=args.adaptive_width,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.texts[0],
                    "tokens": len(result.token_ids[0]),
                    "forwards": result.forwards[0],
                    "tokens_per_forward": round(result.tokens_per_forward, 4),
                    "accepted_per_step": result.accepted_per_step[0],
                }
            )
        )
    else:
        print(result.texts[0])
    return 0
