"""vLLM's scheduler, with two additions for MARS.

1. Threshold rows: an accepted mask prediction is a real token whose keys and values were
   computed from a mask. vLLM rolls back only rejected drafts; this also rolls back the accepted
   mask positions, so the next step feeds those tokens again as real inputs (as marslm's own
   cursor cache re-feeds pending tokens). Without it, later tokens attend to mask KV.
2. Every forward counts into the request's acceptance metrics, drafts or not, so that the
   metrics' step count is the request's forward count (the middleware turns it into
   ``usage.tokens_per_forward``).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from .request_settings import THRESHOLD, PluginConfig, request_settings


class MarsScheduler(Scheduler):
    roll_back_accepted_masks = True

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.mars = PluginConfig.from_vllm_config(vllm_config)

    def update_from_output(self, scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        with_drafts = scheduler_output.scheduled_spec_decode_tokens
        roll_back = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            new_tokens = sampled[index[req_id]] if sampled and req_id in index else []
            if request is None or not new_tokens:
                continue
            if req_id not in with_drafts:
                if request.spec_decode_metrics is not None:
                    request.spec_decode_metrics.observe(num_draft_tokens=0, num_accepted=0)
            elif self.roll_back_accepted_masks and self._mode(request) == THRESHOLD:
                roll_back[req_id] = len(new_tokens) - 1  # all but the AR token came from masks
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id, n in roll_back.items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                request.num_computed_tokens -= n
        return outputs

    def _mode(self, request) -> int:
        return request_settings(request.sampling_params, self.mars).mode
