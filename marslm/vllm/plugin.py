"""vLLM plugin entry points (registered in marslm's pyproject.toml).

``vllm.general_plugins`` -> :func:`register`, run in every vLLM process: it installs the MARS
rejection sampler in each model runner whose drafter is :class:`MarsProposer`. vLLM builds its
``RejectionSampler`` inside the runner and has no registration point for another acceptance
rule, so the runner's constructor is wrapped once; runners without the MARS proposer are left
exactly as they were.

``vllm.logits_processors`` -> :class:`MarsRequestCheck`: vLLM asks every logits-processor class
to validate each request's ``SamplingParams`` in the front end, which is where a bad ``tau``
becomes an HTTP 400. It changes no logits.
"""

from __future__ import annotations

import functools

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from ..errors import UserError
from .request_settings import check_request, is_greedy


def register() -> None:
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


def _attach(runner) -> None:
    from .proposer import MarsProposer
    from .sampler import MarsRejectionSampler, MarsRows

    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, MarsProposer):
        return
    rows = MarsRows(runner, drafter.config)
    drafter.rows = rows
    runner.rejection_sampler = MarsRejectionSampler(runner.sampler, runner.speculative_config, runner.device, rows=rows)


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
