"""``marslm serve``: an OpenAI-compatible server, marslm's own engine or vLLM's with the MARS
plugin; its options are ``ServeConfig``'s fields."""

from __future__ import annotations

from ..decode.params import MASK_BATCH_LIMIT
from ..errors import UserError
from ..serve.config import no_extra_args
from .common import add_drafter

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
    from ..settings import from_args

    config = from_args(ServeConfig, args, drafting=from_args(DraftOptions, args))
    check_model_source(args.model)
    if config.engine == "vllm":
        return _serve_vllm(args.model, config, args.vllm_args)
    no_extra_args(args)
    from ..serve.http import serve

    serve(args.model, config)
    return 0


def _serve_vllm(model: str, config, vllm_args: list[str]) -> int:
    from ..serve.config import served_names
    from ..vllm.launch import exec_server, serve_command

    if config.tau_policy != "fixed":
        raise UserError("--tau-policy adaptive is marslm's engine; vLLM serves a fixed default tau")
    if config.threads is not None:
        raise UserError("--threads is marslm's engine; vLLM's CPU build takes VLLM_CPU_OMP_THREADS_BIND")
    # the default fallback is marslm's engine's; vLLM reads every mask at every step (the paper's rule)
    if config.mask_batch_limit not in (None, MASK_BATCH_LIMIT):
        raise UserError("--mask-batch-limit is marslm's engine; the vLLM plugin reads masks at every batch size")
    if config.drafting.draft_model is not None:
        raise UserError(
            "--draft-model is marslm's engine; with vLLM, its own draft-model speculative decoding "
            "(vllm serve --speculative-config) serves a separate drafter, without the MARS plugin"
        )
    exec_server(
        serve_command(
            model,
            host=config.host,
            port=config.port,
            tau=config.tau,
            api_key=config.api_key,
            served_model_names=served_names(model, config.served_model_name),
            max_batch=config.max_batch,
            log_level=config.log_level,
            vllm_args=vllm_args,
        )
    )
    return 0
