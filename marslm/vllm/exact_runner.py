"""An exact checkpoint inside vLLM's model runner: the adapter read by mask tokens and by nothing else.

Three pieces, installed on a runner whose ``additional_config`` names an exported adapter
(exact.py), by :func:`install` from the plugin (plugin.py):

    the step's gate    before each step's inputs are prepared, where the proposer's masks sit in the
                       flat token layout (``exact.mask_gate``)
    the LoRA mapping   vLLM's per-token adapter index, set from the gate instead of per request:
                       marslm's adapter at the masks, none (-1) everywhere else
    the mask rows      the embedding, wrapped: at the masks its output is the row of each one's
                       offset; their ids are never looked up (one may lie past the vocabulary)

On vLLM's CPU build the LoRA kernels read a token's index -1 as the last adapter slot, so with one
slot every token would get the adapter; :class:`GatedPunicaWrapperCPU` updates the gated tokens
alone, and only what it updates can differ from the original model.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
from torch import nn
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from .exact import LORA_ID, LORA_NAME, ROWS_FILENAME, mask_gate
from .request_settings import PluginConfig


class GatedPunicaWrapperCPU(PunicaWrapperCPU):
    """vLLM's CPU LoRA wrapper for adapters read per token: tokens with no adapter (index -1) are
    left exactly as the base layer computed them, and no per-segment metadata is built (a gated
    batch alternates adapter and none many times more often than vLLM sizes that metadata for)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._factors: dict = {}
        self._by_slot: list = []

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        self._update_base_metadata(mapping, lora_index_to_id, max_loras, vocab_size)
        self.is_prefill = False
        indices = self.token_lora_indices
        gated = (indices >= 0).nonzero().squeeze(1)
        slots = indices[gated]
        self._by_slot = [(int(s), gated[slots == s]) for s in slots.unique().tolist()]

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
        flat = y.view(-1, y.shape[-1])[:, : sum(output_slices)]  # the slices lie side by side from column 0
        x = x.reshape(-1, x.shape[-1])
        for slot, tokens in self._by_slot:
            a_t, b_t = self._fused(lora_a_stacked, lora_b_stacked, slot)
            update = x.index_select(0, tokens).to(a_t.dtype) @ a_t
            update = (update * scale if scale != 1.0 else update) @ b_t
            flat.index_add_(0, tokens, update.to(flat.dtype))
        return y

    def _fused(self, lora_a_stacked, lora_b_stacked, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's factors over every output slice of a layer (a packed q/k/v has three): the ``a``s
        stacked, the ``b``s block-diagonal, so that a step's update is two products, not two per
        slice. Rebuilt when vLLM writes new weights into the slot (their versions change)."""
        # a: [slots, 1, rank, in], b: [slots, 1, out, rank]
        versions = tuple(t._version for t in (*lora_a_stacked, *lora_b_stacked))
        key = (id(lora_a_stacked[0]), slot)
        cached = self._factors.get(key)
        if cached is None or cached[0] != versions:
            a_t = torch.cat([a[slot, 0] for a in lora_a_stacked]).float().T.contiguous()
            b_t = torch.block_diag(*[b[slot, 0] for b in lora_b_stacked]).float().T.contiguous()
            cached = self._factors[key] = (versions, a_t, b_t)
        return cached[1], cached[2]

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        return y  # the head is never a target: its outputs are the original's


QUALNAME = f"{__name__}.GatedPunicaWrapperCPU"


class MaskRowsEmbedding(nn.Module):
    """The model's input embedding, with the mask rows put at the step's mask positions."""

    def __init__(self, base: nn.Module, rows: torch.Tensor):
        super().__init__()
        self.base = base
        self.register_buffer("rows", rows, persistent=False)
        # (mask positions, their offsets, the step's token count): set before a step, read by its forward
        self.gate: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        gate, self.gate = self.gate, None  # one forward's: a profile or warm-up run sees none
        if gate is None or not len(gate[0]):
            return self.base(input_ids)
        where, offsets, tokens = gate
        if tokens > len(input_ids):
            raise RuntimeError(f"a mask gate for {tokens} tokens reached a forward of {len(input_ids)}")
        out = self.base(input_ids.index_fill(0, where, 0))
        return out.index_copy(0, where, self.rows[offsets].to(out.dtype))


def install(runner, config: PluginConfig) -> None:
    """Serve ``config``'s exported adapter on ``runner`` (a V1 model runner, before its model loads)."""
    from safetensors.torch import load_file

    rows = load_file(f"{config.exact_lora}/{ROWS_FILENAME}")["rows"]
    runner._mars_gate = None
    load_model, prepare_inputs = runner.load_model, runner._prepare_inputs

    @functools.wraps(load_model)
    def load_with_rows(*args, **kwargs):
        with _gated_punica_wrapper():
            load_model(*args, **kwargs)
        parent, name, embedding = _input_embedding(runner.model)
        weight = next(embedding.parameters())
        setattr(parent, name, MaskRowsEmbedding(embedding, rows.to(device=weight.device, dtype=weight.dtype)))
        runner._mars_embedding = getattr(parent, name)

    @functools.wraps(prepare_inputs)
    def prepare_with_gate(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        batch = runner.input_batch
        where, offsets = mask_gate(
            num_scheduled_tokens, batch.spec_token_ids[: batch.num_reqs], config.mask_token_id, config.exact_rows
        )
        runner._mars_gate = where
        to = {"device": runner.device}
        tokens = int(np.sum(num_scheduled_tokens))
        runner._mars_embedding.gate = (torch.from_numpy(where).to(**to), torch.from_numpy(offsets).to(**to), tokens)
        return prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    runner.load_model = load_with_rows
    runner._prepare_inputs = prepare_with_gate
    if config.exact_rank:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(LORA_NAME, LORA_ID, config.exact_lora)
        runner.set_active_loras = functools.partial(_set_gated_loras, runner, request)


def _set_gated_loras(runner, request, input_batch, num_scheduled_tokens, num_sampled_tokens=None, *args, **kwargs):
    """vLLM's ``set_active_loras`` with the adapter mapped per token, by the step's gate."""
    if input_batch.request_lora_mapping[: input_batch.num_reqs].any():
        raise RuntimeError("a request with a LoRA of its own reached an exact checkpoint's runner")
    tokens = np.zeros(int(np.sum(num_scheduled_tokens)), dtype=np.int64)
    tokens[runner._mars_gate] = LORA_ID
    sampled = int(np.sum(num_sampled_tokens)) if num_sampled_tokens is not None else input_batch.num_reqs
    runner._set_active_loras((0,) * sampled, tuple(tokens.tolist()), {request})


@contextlib.contextmanager
def _gated_punica_wrapper():
    """vLLM picks its LoRA wrapper by platform while the model loads: on a CPU, the gated one."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    platform = type(current_platform)
    original = platform.__dict__["get_punica_wrapper"]
    platform.get_punica_wrapper = classmethod(lambda cls: QUALNAME)
    try:
        yield
    finally:
        platform.get_punica_wrapper = original


def _input_embedding(model: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """The module holding the token embedding, its attribute name, and the embedding itself."""
    for name, module in model.named_modules():
        if name.endswith("embed_tokens") and not isinstance(module, MaskRowsEmbedding):
            parent_name, _, attribute = name.rpartition(".")
            return model.get_submodule(parent_name), attribute, module
    raise RuntimeError(f"{type(model).__name__} has no embed_tokens module for the mask rows")
