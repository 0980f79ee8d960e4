"""vLLM engine arguments that turn MARS decoding on: one recipe for ``LLM(...)`` and ``vllm serve``.

MARS rides on vLLM's speculative-decoding path. The checkpoint is its own drafter, with no extra
weights and no extra forward: the proposer drafts mask tokens, the target forward that verifies
drafts also reads the masks, and three small pieces decide what is kept:

    speculative_config   {"method": "custom_class", "model": PROPOSER}: drafts [predictions,] masks
    scheduler_cls        SCHEDULER: re-feeds accepted mask positions as real tokens (threshold)
    rejection sampler    installed by the ``vllm.general_plugins`` entry point (plugin.py)

Per-request settings travel in ``SamplingParams.extra_args``; the server's defaults and the
checkpoint's mask token in ``additional_config`` (settings.py). This module imports nothing of
vLLM: the CLI builds server command lines with it from marslm's own environment.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import MarsConfig
from .settings import ServingConfig

PROPOSER = "marslm.vllm.proposer.MarsProposer"
SCHEDULER = "marslm.vllm.scheduler.MarsScheduler"
MIDDLEWARE = "marslm.vllm.middleware.MarsMiddleware"
SPECULATIVE = ("mars", "ngram", "none")
NGRAM_MAX = 4


def serving_config(
    model_dir: str | Path, *, tau: float = 0.95, metric: str = "prob", mode: str = "threshold"
) -> ServingConfig:
    """The checkpoint's mask token and block size (``marslm.json``), or none for a plain AR checkpoint."""
    mars = MarsConfig.load(model_dir) if Path(model_dir).is_dir() else None
    if mars is None or mars.stage != "mars" or mars.mask_token_id is None or mars.block_size < 1:
        return ServingConfig(tau=tau, metric=metric, mode=mode)
    return ServingConfig(mask_token_id=mars.mask_token_id, num_masks=mars.block_size, tau=tau, metric=metric, mode=mode)


def engine_kwargs(
    model_dir: str | Path,
    *,
    speculative: str = "mars",
    serving: ServingConfig | None = None,
    cpu: bool = False,
    scheduler_cls: str = SCHEDULER,
) -> dict:
    """Keyword arguments of ``vllm.LLM`` / ``EngineArgs`` for one model directory.

    ``speculative``: ``mars`` (falls back to none for a checkpoint without masks), ``ngram``
    (vLLM's prompt lookup, a baseline) or ``none``. ``cpu`` adds what vLLM's CPU backend needs
    for small models: fp32, eager mode, KV blocks of 32.
    """
    if speculative not in SPECULATIVE:
        raise ValueError(f"speculative must be one of {SPECULATIVE}, got {speculative!r}")
    serving = serving or serving_config(model_dir)
    kwargs: dict = {"model": str(model_dir)}
    if speculative == "mars" and serving.mask_token_id is not None:
        kwargs["speculative_config"] = {
            "method": "custom_class",
            "model": PROPOSER,
            "num_speculative_tokens": serving.num_speculative_tokens,
        }
        kwargs["additional_config"] = serving.to_additional_config()
    elif speculative == "ngram":
        kwargs["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": max(serving.num_masks, 1),
            "prompt_lookup_max": NGRAM_MAX,
            "prompt_lookup_min": 2,
        }
    if "speculative_config" in kwargs:
        # Per-request acceptance counts: the scheduler counts every forward into them, so the
        # middleware can report tokens per forward in `usage`.
        kwargs["per_request_spec_decode_metrics"] = "summary"
        kwargs["scheduler_cls"] = scheduler_cls
    if cpu:
        kwargs.update(dtype="float32", enforce_eager=True, block_size=32)
    return kwargs


def server_args(kwargs: dict) -> list[str]:
    """``vllm serve`` flags for ``engine_kwargs`` (the model goes first, as vLLM wants it)."""
    args = [kwargs["model"]]
    for name, value in kwargs.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    if "speculative_config" in kwargs:
        args += ["--middleware", MIDDLEWARE]
    return args
