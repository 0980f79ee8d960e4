"""``marslm serve``: an OpenAI-compatible server, marslm's own engine or vLLM's with the MARS
plugin; its options are ``ServeConfig``'s fields."""

from __future__ import annotations

from .common import add_compile, add_drafter

COMMAND = "serve"


def add_parser(sub) -> None:
    from ..serve.config import ServeConfig
    from ..settings import add_options

    srv = sub.add_parser(
        COMMAND,
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Start a FastAPI + uvicorn server with continuous batching: /v1/completions, "
        "/v1/chat/completions (both with stream), /v1/models, /health, /metrics (Prometheus), "
        "/admin/tau and /admin/policy. Requests may add tau, metric, block_size, mode, "
        "temperature, top_p, top_k, seed and stop. With --draft-model, a separate drafter proposes "
        "--num-draft-tokens per step for the model to verify: it drafts for one row, so requests "
        "decode one at a time (--max-batch is taken as 1), in threshold mode only. With --engine "
        "vllm, vLLM serves instead (using --host, --port, --api-key, --served-model-name, "
        "--max-batch, --tau, --log-level).",
    )
    srv.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    add_options(srv, ServeConfig)
    add_compile(srv)
    add_drafter(srv)
    srv.add_argument(
        "vllm_args",
        nargs="*",
        metavar="-- VLLM_ARGS",
        help="with --engine vllm: options for `vllm serve` after --, e.g. -- --tensor-parallel-size 2",
    )
    srv.set_defaults(run=run)


def run(args) -> int:
    from ..decode.draft_options import DraftOptions
    from ..modeling import check_model_source
    from ..serve.config import ServeConfig
    from ..serve.engines import engine
    from ..settings import from_args

    config = from_args(ServeConfig, args, drafting=from_args(DraftOptions, args))
    check_model_source(args.model)
    return engine(config.engine).serve(args.model, config, args.vllm_args)
