"""``marslm show``: one generation with the tokens of each forward shaded together."""

from __future__ import annotations

import os
import sys

from .common import add_device

COMMAND = "show"


def add_parser(sub) -> None:
    from ..decode.params import DecodingParams
    from ..settings import add_options

    show = sub.add_parser(
        COMMAND,
        help="one generation with the tokens of each forward shaded together",
        description="Decode PROMPT once and shade each forward's run of accepted tokens, darker for longer "
        "runs (neighbouring runs alternate blue/green): ANSI colours in the terminal, or a self-contained "
        "HTML page with a legend and the stats.",
    )
    show.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    show.add_argument("--prompt", required=True, help="the user message")
    add_options(
        show, DecodingParams, defaults={"tau": 0.9}, skip=("mode", "temperature", "top_p", "top_k", "seed", "stop")
    )
    add_device(show)
    show.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page to FILE")
    show.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="ANSI colours in the terminal (auto: when stdout is a terminal and NO_COLOR is unset)",
    )
    show.set_defaults(run=run)


def run(args) -> int:
    from ..decode.params import DecodingParams
    from ..eval.show import render_ansi, render_html, show_generation
    from ..files import output_file, write_text_atomically
    from ..settings import from_args
    from .common import load_for_decoding

    if args.html:
        output_file(args.html, "--html")
    model, tokenizer, params = load_for_decoding(args.model, from_args(DecodingParams, args), args.device)
    shown = show_generation(
        model,
        tokenizer,
        args.prompt,
        tau=params.tau,
        metric=params.metric,
        block_size=params.block_size,
        max_new_tokens=params.max_new_tokens,
    )
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    print(render_ansi(shown, color=color))
    if args.html:
        write_text_atomically(args.html, render_html(shown))
        print(f"wrote {args.html}")
    return 0
