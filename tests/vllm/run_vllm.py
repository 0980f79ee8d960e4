"""Runs vLLM engines over a job file and writes what they decoded. Runs inside vLLM's environment.

    python tests/vllm/run_vllm.py JOB.json OUT.json

JOB: {"model": DIR, "max_model_len": N, "engines": [{"name": ..., "speculative": "mars" | "none",
      "no_rollback": bool, "ungated": bool, "mask_batch_limit": N, "batches": {NAME: [{"prompt_token_ids", "max_tokens",
      "extra_args", "own_lora": bool}]}}]}
OUT: {ENGINE: {BATCH: [{"token_ids", "finish_reason", "forwards"}]}}, with the stop token kept
as vLLM returns it; a batch vLLM refused is {"error": its message}. Each batch is one ``generate``
call, so its requests share the engine's batch.

Engines run one after another in this process (vLLM's in-process engine core), so that the
negative controls can replace a piece of the plugin here: ``no_rollback`` its scheduler, and
``ungated`` (an exact checkpoint) its per-token LoRA mapping, by vLLM's per-request one.
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from marslm.vllm import exact, exact_runner  # noqa: E402
from marslm.vllm.engine_args import engine_kwargs, plugin_config  # noqa: E402
from marslm.vllm.scheduler import MarsScheduler  # noqa: E402


class NoRollbackScheduler(MarsScheduler):
    """The negative control: accepted mask positions keep the keys and values computed from masks."""

    roll_back_accepted_masks = False


def ungated_loras(runner, request, input_batch, num_scheduled_tokens, num_sampled_tokens=None, *args, **kwargs):
    """The negative control of an exact checkpoint: vLLM's own mapping, one LoRA per request, so
    every token of a MARS request reads the adapter, its clean tokens too."""
    tokens = (exact.LORA_ID,) * int(sum(num_scheduled_tokens))
    sampled = int(sum(num_sampled_tokens)) if num_sampled_tokens is not None else input_batch.num_reqs
    runner._set_active_loras((exact.LORA_ID,) * sampled, tokens, {request})


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMError
    from vllm.lora.request import LoRARequest
    from vllm.platforms import current_platform

    results = {}
    gated = exact_runner._set_gated_loras
    for engine in job["engines"]:
        exact_runner._set_gated_loras = ungated_loras if engine.get("ungated") else gated
        kwargs = engine_kwargs(
            job["model"],
            speculative=engine["speculative"],
            plugin=plugin_config(job["model"], mask_batch_limit=engine.get("mask_batch_limit")),
            cpu=current_platform.is_cpu(),
            **({"scheduler_cls": NoRollbackScheduler} if engine.get("no_rollback") else {}),
        )
        if not current_platform.is_cpu():  # engines follow one another; the server test needs room too
            kwargs["gpu_memory_utilization"] = 0.25
        llm = LLM(**kwargs, max_model_len=job["max_model_len"], seed=0, max_num_seqs=64)
        results[engine["name"]] = {}
        for name, requests in engine["batches"].items():
            prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
            params = [
                SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], extra_args=r.get("extra_args"))
                for r in requests
            ]
            own = [LoRARequest("own", 7, kwargs["model"]) if r.get("own_lora") else None for r in requests]
            try:
                outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=own if any(own) else None)
            except (ValueError, VLLMError) as exc:  # vLLM's refusal of a request
                results[engine["name"]][name] = {"error": str(exc)}
                continue
            results[engine["name"]][name] = [_record(o.outputs[0]) for o in outputs]
        del llm
        gc.collect()
    return results


def _record(completion) -> dict:
    metrics = completion.spec_decode_metrics
    return {
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "forwards": sum(metrics.histogram) if metrics is not None else None,
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    out = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
