"""Issue 50's guard: what a MARS training step materialises beyond an AR step, counted, not timed.

A MARS step runs one forward over ``[clean ; masked]`` under a structured mask; an AR step runs
causal attention, which needs no mask at all. So the tensors with one element per (query, key)
pair are MARS's own cost. They are counted here as bytes allocated per pair during a whole
forward and backward: the mask rule's boolean passes and one additive mask for sdpa, whatever the
layer count. Two regressions read as more: a block index per pair in int64 (8 bytes a pair per
integer pass, b9ea30c), and a boolean mask that sdpa turns into an additive one again at every
layer, keeping each copy for the backward (4 bytes a pair per layer). The attention calls and the
forwards are counted too: one forward, as in an AR step, and attention that splits the streams
(masks.two_stream_sdpa): the clean queries over the clean keys alone, causally and with no mask
where a row holds one sequence, so that a layer scores about three quarters of the pairs one call
over the whole mask would.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from marslm.chat import IGNORE
from marslm.training.objective import LossOptions, Masking, ar_loss, mars_loss, two_stream_batch
from tests.helpers import tiny_llama

ROWS, LENGTH, PROMPT, BLOCK, MASK_ID, LAYERS = 2, 256, 32, 4, 3, 4
# The mask rule's boolean passes (one byte each) and one float32 additive mask come to 19 bytes a
# pair at any depth; at 4 layers 1f8dba3 allocated 47 (two int64 passes, four per-layer copies) and
# c70a1f0 30 (the four copies).
MAX_BYTES_PER_PAIR = 24


class _Allocations(TorchDispatchMode):
    """Every tensor an op allocates (a view or an in-place result shares its input's storage and is
    not counted), as ``(op, dtype, numel, bytes)``; and the attention calls of the forwards."""

    def __init__(self):
        super().__init__()
        self.tensors: list[tuple[str, torch.dtype, int, int]] = []
        self.attention_calls: list[tuple[int, int, bool]] = []  # (queries, keys, whether a mask was given)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "scaled_dot_product" in name and "backward" not in name:
            named = {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **(kwargs or {})}
            masked = named.get("attn_mask") is not None
            self.attention_calls.append((args[0].shape[-2], args[1].shape[-2], masked))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.tensors.append((name, t.dtype, t.numel(), t.numel() * t.element_size()))
        return out


def _batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 64, (ROWS, LENGTH), generator=generator)
    labels = ids.clone()
    labels[:, :PROMPT] = IGNORE
    return ids, labels


def _count(model, stage: str, autocast: bool = False, **options):
    """``(allocations, attention calls, forwards)`` of one forward and backward of a stage's loss."""
    ids, labels = _batch()
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    mode = _Allocations()
    try:
        with torch.random.fork_rng(devices=[]), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), mode:
            torch.manual_seed(0)  # random phases: the draw _pairs makes
            if stage == "mars":
                loss = mars_loss(model, ids, labels, LossOptions(BLOCK, MASK_ID, **options))["loss"]
            else:
                loss = ar_loss(model, ids, labels)["loss"]
            loss.backward()
    finally:
        hook.remove()
    return mode.tensors, mode.attention_calls, len(forwards)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(64, hidden_size=32, num_hidden_layers=LAYERS, seed=0).float().train()


def _pairs(masking: Masking) -> int:
    ids, labels = _batch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        phases = masking.phases(None, ROWS, BLOCK)
    width = two_stream_batch(ids, labels, BLOCK, MASK_ID, phases=phases).input_ids.shape[1]
    return ROWS * width * width


@pytest.mark.parametrize(
    "masking, autocast",
    [(Masking(), False), (Masking(random_phase=True, streams=2, offset_decay=0.8), False), (Masking(), True)],
    ids=["default", "copies-and-phases", "bf16-autocast"],
)
def test_mars_step_allocates_per_pair_only_its_boolean_mask_and_one_additive_copy(model, masking, autocast):
    pairs = _pairs(masking)
    tensors, calls, forwards = _count(model, "mars", autocast=autocast, masking=masking)
    per_pair = [t for t in tensors if t[2] >= pairs]
    integer = [t for t in per_pair if not (t[1] == torch.bool or t[1].is_floating_point)]
    floating = [t for t in per_pair if t[1].is_floating_point]
    bytes_per_pair = sum(t[3] for t in per_pair) / pairs
    assert (integer, len(floating), bytes_per_pair <= MAX_BYTES_PER_PAIR) == ([], 1, True), (
        f"{bytes_per_pair:.1f} bytes a pair; integer tensors with one element per (query, key) pair: {integer}; "
        f"floating ones (the additive mask, built once, not once per layer): {floating}"
    )
    assert forwards == 1
    width = round((pairs / ROWS) ** 0.5)
    scored = sum(q * k for q, k, _ in calls) / LAYERS
    assert scored <= 0.8 * width * width, f"{scored / width**2:.2f} of the pairs a layer scored"
    assert [c for c in calls if c[:2] == (LENGTH, LENGTH)] == [(LENGTH, LENGTH, False)] * LAYERS  # the clean stream


def test_ar_step_allocates_nothing_per_pair_and_makes_as_many_attention_calls(model):
    tensors, calls, forwards = _count(model, "ar")
    assert not [t for t in tensors if t[2] >= ROWS * LENGTH * LENGTH]
    assert (calls, forwards) == ([(LENGTH, LENGTH, False)] * LAYERS, 1)
