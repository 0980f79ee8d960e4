"""vLLM plugin entry points (registered in marslm's pyproject.toml).

``vllm.general_plugins`` -> :func:`register`, run in every vLLM process: it installs the MARS
rejection sampler in each model runner whose drafter is :class:`MarsProposer`. vLLM builds its
``RejectionSampler`` inside the runner and has no registration point for another acceptance
rule, so the runner's constructor is wrapped once; runners without the MARS proposer are left
exactly as they were. A runner serving an exact checkpoint also gets its adapter (exact_runner.py).
Two vLLM methods are wrapped for exact checkpoints as well: the front end's LoRA check refuses a
request's own LoRA beside the adapter, and the weight loader leaves the adapter's file out of the
model's weights.

``vllm.logits_processors`` -> :class:`MarsRequestCheck`: vLLM asks every logits-processor class
to validate each request's ``SamplingParams`` in the front end, which is where a bad ``tau``
becomes an HTTP 400. It changes no logits.
"""

from __future__ import annotations

import functools
import os

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from ..errors import UserError
from ..mars_json import ADAPTER_FILENAME
from .request_settings import PluginConfig, check_request, is_greedy


def register() -> None:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.__init__, "_marslm", False):
        return
    original = GPUModelRunner.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _attach(self)

    __init__._marslm = True
    GPUModelRunner.__init__ = __init__
    InputProcessor._validate_lora = _refuse_a_second_lora(InputProcessor._validate_lora)
    DefaultModelLoader._prepare_weights = _without_the_adapter(DefaultModelLoader._prepare_weights)


def _without_the_adapter(prepare_weights):
    """vLLM loads every ``*.safetensors`` of a local model directory that has no index file; an exact
    checkpoint's adapter file is not the model's, so it is left out, and the checkpoint loads as the
    original did (its adapter is served through the LoRA export, exact.py)."""

    @functools.wraps(prepare_weights)
    def _prepare_weights(self, *args, **kwargs):
        folder, files, *rest = prepare_weights(self, *args, **kwargs)
        return (folder, [f for f in files if os.path.basename(f) != ADAPTER_FILENAME], *rest)

    return _prepare_weights


def _refuse_a_second_lora(validate):
    """An exact checkpoint's adapter is the LoRA of every mask token, and vLLM applies one LoRA per
    token: a request's own LoRA would leave its masks predicting for another model than its answer's."""

    @functools.wraps(validate)
    def _validate_lora(self, lora_request) -> None:
        if lora_request is not None and PluginConfig.from_vllm_config(self.vllm_config).exact_lora:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(
                "this server serves an exact MARS checkpoint, whose adapter is the LoRA its mask tokens read; "
                "vLLM applies one LoRA per token, so a request cannot bring a LoRA of its own"
            )
        validate(self, lora_request)

    return _validate_lora


def _attach(runner) -> None:
    from .proposer import MarsProposer
    from .sampler import MarsRejectionSampler, MarsRows

    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, MarsProposer):
        return
    rows = MarsRows(runner, drafter.config)
    drafter.rows = rows
    runner.rejection_sampler = MarsRejectionSampler(runner.sampler, runner.speculative_config, runner.device, rows=rows)
    if drafter.config.exact_lora:
        from .exact_runner import install

        install(runner, drafter.config)


class MarsRequestCheck(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        try:
            check_request(sampling_params.extra_args or {}, greedy=is_greedy(sampling_params.temperature))
        except UserError as exc:
            raise ValueError(str(exc)) from None

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
