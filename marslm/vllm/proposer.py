"""The drafter: mask tokens, and in lossless mode the last step's mask predictions before them.

vLLM calls ``propose`` once per step, after sampling, with each row's new tokens; it returns
each row's drafts for the next step. MARS needs no second model and no forward of its own: a
draft of B masks is read by the next target forward itself.

    OFF rows        []                                  vLLM's plain decoding
    every row       [], while more rows than the server's --mask-batch-limit decode together
    THRESHOLD rows  [M] * B
    LOSSLESS rows   [predictions of last step's masks] + [M] * B
                    (the predictions only when every draft of that step was accepted: the
                    masks saw those drafts, so their predictions hold only on that path)
"""

from __future__ import annotations

from .request_settings import LOSSLESS, OFF, PluginConfig


class MarsProposer:
    """``speculative_config={"method": "custom_class", "model": "marslm.vllm.proposer.MarsProposer", ...}``."""

    def __init__(self, vllm_config):
        self.config = PluginConfig.from_vllm_config(vllm_config)
        if self.config.mask_token_id is None:
            raise ValueError(
                "MarsProposer needs additional_config['marslm'] (marslm.vllm.engine_args.engine_kwargs "
                "sets it from the checkpoint's marslm.json)"
            )
        self.masks = [self.config.mask_token_id] * self.config.num_masks
        self.rows = None  # MarsRows, attached by the plugin together with the sampler

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the target model reads the masks itself."""

    def propose(self, sampled_token_ids: list[list[int]], *args, **kwargs) -> list[list[int]]:
        if self.rows is None:
            raise RuntimeError(
                "the marslm vLLM plugin is not loaded: install marslm in vLLM's environment "
                "(its `vllm.general_plugins` entry point attaches the MARS sampler)"
            )
        rows = self.rows.refresh()
        drafts = rows.take_next_drafts()
        limit = self.config.mask_batch_limit
        if limit is not None and len(sampled_token_ids) > limit:  # plain steps while the batch is above it
            return [[] for _ in sampled_token_ids]
        if drafts is not None:
            tokens, lengths = (t.cpu().numpy() for t in drafts)  # the runner has synced already
        out = []
        for i, new_tokens in enumerate(sampled_token_ids):  # vLLM's interface: one list per row
            if not new_tokens or rows.mode[i] == OFF:
                out.append([])
            elif rows.mode[i] == LOSSLESS and drafts is not None and lengths[i]:
                out.append(self._predictions(tokens[i, : lengths[i]].tolist()) + self.masks)
            else:
                out.append(self.masks)
        return out

    def _predictions(self, predicted: list[int]) -> list[int]:
        """The drafts before the masks: up to the first that is the mask token itself, since a draft
        of that id is read as a mask (the sampler hides it, an exact checkpoint gates it)."""
        mask = self.config.mask_token_id
        return predicted[: predicted.index(mask)] if mask in predicted else predicted
