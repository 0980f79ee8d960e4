"""marslm's side of the vLLM engine: find vLLM's environment and start its server there.

vLLM pins its own torch and transformers, which marslm's do not match, so vLLM lives in a
virtual environment of its own (``make vllm-env`` makes ``.venv-vllm`` with marslm installed
into it). The ``marslm`` command runs in marslm's environment and starts vLLM's server in that
one, as ``python -m marslm.vllm.serve``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import UserError

ENV_VAR = "MARSLM_VLLM_VENV"
DEFAULT_VENV = ".venv-vllm"


def vllm_python() -> Path:
    """The Python of vLLM's environment: ``$MARSLM_VLLM_VENV``, else ``.venv-vllm`` in this checkout
    (or in the working directory). Raises ``UserError`` when there is none."""
    if os.environ.get(ENV_VAR):
        candidates = [Path(os.environ[ENV_VAR])]
    else:
        candidates = [Path(__file__).resolve().parents[2] / DEFAULT_VENV, Path.cwd() / DEFAULT_VENV]
    for venv in candidates:
        python = venv / "bin" / "python"
        if python.is_file():
            return python
    raise UserError(
        f"the vLLM engine needs vLLM's own environment, and there is none at {candidates[0]}: "
        f"run `make vllm-env` (or point {ENV_VAR} at one with vLLM and marslm installed)"
    )


def serve_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    tau: float = 0.95,
    speculative: str = "mars",
    api_key: str | None = None,
    served_model_names: tuple[str, ...] = (),
    max_batch: int | None = None,
    mask_batch_limit: int | None = None,
    log_level: str = "info",
    vllm_args: list[str] = (),
) -> list[str]:
    """The command line that serves ``model`` with vLLM (``vllm_args`` go to ``vllm serve`` as they are)."""
    cmd = [
        str(vllm_python()),
        "-m",
        "marslm.vllm.serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--tau",
        repr(tau),
        "--speculative",
        speculative,
        "--log-level",
        log_level,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    if served_model_names:
        cmd += ["--served-model-name", *served_model_names]
    if max_batch:
        cmd += ["--max-batch", str(max_batch)]
    if mask_batch_limit is not None:
        cmd += ["--mask-batch-limit", str(mask_batch_limit)]
    return cmd + ["--", *vllm_args] if vllm_args else cmd


def exec_server(cmd: list[str]) -> None:
    """Replace this process with vLLM's server (signals and exit status are then vLLM's own)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)


def serve_checkpoint(model: str, config, vllm_args: list[str]) -> int:
    """``marslm serve --engine vllm``: this process becomes vLLM's server on ``model`` (a ``ServeConfig``).
    The checkpoint is proved here first (an exact one's adapter too), so that a bad one is refused
    in one line before vLLM starts."""
    from ..serve.config import served_names
    from .engine_args import plugin_config

    limit = None if config.mask_batch_limit == "auto" else config.mask_batch_limit
    plugin_config(model, tau=config.tau, mask_batch_limit=limit)  # refuses a bad checkpoint in one line first
    cmd = serve_command(
        model,
        host=config.host,
        port=config.port,
        tau=config.tau,
        api_key=config.api_key,
        served_model_names=served_names(model, config.served_model_name),
        max_batch=config.max_batch,
        mask_batch_limit=limit,
        log_level=config.log_level,
        vllm_args=vllm_args,
    )
    if config.mask_batch_limit == "auto":  # the default: its cost table times marslm's engine's steps, not vLLM's
        print(
            "marslm serve: vLLM serves without a mask batch limit (auto reads a cost table timed on marslm's "
            "engine); --mask-batch-limit N sets one",
            file=sys.stderr,
        )
    exec_server(cmd)
    return 0
