"""The exact-mode adapter (marslm/adapter.py): it acts at mask positions and nowhere else."""

from __future__ import annotations

import pytest
import torch

from marslm import adapter as adapter_mod
from marslm.adapter import AdapterSpec, MaskAdapter, adapter_of, mask_offsets
from marslm.masks import causal_step_mask, for_attention, two_stream_mask


def _trained_like(adapter: MaskAdapter, seed: int = 1) -> MaskAdapter:
    """Non-zero LoRA factors and distinct rows, as after training (fresh ones change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return adapter


@pytest.fixture
def model_and_adapter(make_tiny_model):
    model = make_tiny_model(vocab_size=None)
    mask_id = model.get_input_embeddings().weight.shape[0]  # past the last row: a virtual token
    adapter = _trained_like(MaskAdapter.for_model(model, mask_id, rank=4, rows=3))
    return model, adapter, mask_id


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def _gated(adapter, model, ids, mask_id, grad: bool = False):
    """The logits of a forward with masks where the test put the mask id (the decoder's gate)."""
    with adapter.gate(ids == mask_id), torch.set_grad_enabled(grad):
        return model(input_ids=ids).logits.detach()


def test_gates_every_decoder_linear_and_starts_as_no_change(make_tiny_model):
    model = make_tiny_model()
    adapter = MaskAdapter.for_model(model, 5, rank=2, rows=1)
    names = adapter.spec.targets
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down in each of two layers
    assert all(".layers." in name for name in names)
    assert all(not lora.b.detach().any() for lora in adapter.lora)
    # the row starts at the mask token's own embedding where the model has one
    assert torch.equal(adapter.rows[0], model.get_input_embeddings().weight[5])


def test_input_without_masks_is_bitwise_the_original(model_and_adapter):
    model, adapter, _ = model_and_adapter
    ids = torch.randint(0, 100, (2, 12))
    before = _logits(model, ids)
    adapter.attach(model)
    assert adapter_of(model) is adapter
    assert torch.equal(_logits(model, ids), before)


def test_the_adapter_acts_at_mask_positions_only(model_and_adapter):
    """A decoding step's layout: clean tokens, then masks. The clean outputs are the original's,
    bit for bit; the masks' outputs move. Applying the update at every position (no gate) fails
    the first assertion."""
    model, adapter, mask_id = model_and_adapter
    ids = torch.cat([torch.randint(0, 100, (2, 9)), torch.full((2, 3), mask_id)], dim=1)
    original = _logits(model, torch.where(ids == mask_id, 0, ids))  # same shapes: same kernels
    adapter.attach(model)
    with adapter.gate(ids == mask_id):
        out = _logits(model, ids)
    assert torch.equal(out[:, :9], original[:, :9])
    assert not torch.allclose(out[:, 9:], original[:, 9:])


def test_an_id_is_never_taken_for_a_mask(make_tiny_model):
    """The adapter acts where the decoder put masks (its gate), not where an input id equals the
    mask id: outside a gate, input holding the id (a mask token with a row of its own, as a
    tokenizer's may have) runs bit for bit as the original does; inside one, it does not."""
    model = make_tiny_model(vocab_size=None)
    adapter = _trained_like(MaskAdapter.for_model(model, 5, rank=4, rows=3))
    ids = torch.tensor([[7, 5, 9, 5, 5, 11]])
    original = _logits(model, ids)
    adapter.attach(model)
    assert torch.equal(_logits(model, ids), original)
    placed = torch.tensor([[False, False, False, False, True, True]])
    with adapter.gate(placed):
        gated = _logits(model, ids)
    assert torch.equal(gated[:, :4], original[:, :4])  # the 5s at columns 1 and 3 are text
    assert not torch.allclose(gated[:, 4:], original[:, 4:])


def test_each_mask_reads_the_row_of_its_offset(model_and_adapter):
    model, adapter, mask_id = model_and_adapter
    seen = {}
    adapter.attach(model)
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.update(out=out))
    ids = torch.cat([torch.randint(0, 100, (1, 4)), torch.full((1, 4), mask_id)], dim=1)
    with adapter.gate(ids == mask_id):
        _logits(model, ids)
    # rows 0, 1, 2 and then the last row again (offsets past the last row read it)
    expected = adapter.rows[[0, 1, 2, 2]]
    assert torch.equal(seen["out"][0, 4:], expected)


def test_offsets_follow_the_attention_mask():
    is_mask = torch.tensor([[False, False, True, True, True]])
    assert mask_offsets(is_mask, None).tolist() == [[-1, -1, 0, 1, 2]]
    dense = torch.as_tensor(causal_step_mask(torch.ones(1, 3, dtype=bool).numpy(), is_mask.numpy() | True))
    assert mask_offsets(is_mask, dense)[is_mask].tolist() == [0, 1, 2]
    # the two-stream training mask: blocks of 2 over 6 positions; the noisy half is all masks
    mask = two_stream_mask(6, 2)[None, None]
    noisy = torch.tensor([[False] * 6 + [True] * 6])
    assert mask_offsets(noisy, mask)[noisy].tolist() == [0, 1, 0, 1, 0, 1]


def test_offsets_read_from_an_additive_mask(make_tiny_model):
    model = make_tiny_model(attn="eager")
    mask = for_attention(two_stream_mask(4, 2)[None, None], model)
    noisy = torch.tensor([[False] * 4 + [True] * 4])
    assert mask_offsets(noisy, mask)[noisy].tolist() == [0, 1, 0, 1]


def test_explicit_offsets_win(model_and_adapter):
    model, adapter, mask_id = model_and_adapter
    seen = {}
    adapter.attach(model)
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.update(out=out))
    ids = torch.full((1, 3), mask_id)
    with adapter.gate(ids == mask_id, torch.tensor([[2, 2, 0]])):
        _logits(model, ids)
    assert torch.equal(seen["out"][0], adapter.rows[[2, 2, 0]])


def test_save_load_round_trip(model_and_adapter, tmp_path):
    model, adapter, mask_id = model_and_adapter
    adapter.attach(model)
    ids = torch.cat([torch.randint(0, 100, (1, 5)), torch.full((1, 3), mask_id)], dim=1)
    with adapter.gate(ids == mask_id):
        expected = _logits(model, ids)
    adapter_mod.save(adapter, tmp_path)
    adapter.detach(model)
    assert adapter_of(model) is None
    spec = AdapterSpec.from_dict(adapter.spec.to_dict(), "test")
    loaded = adapter_mod.load(spec, tmp_path, model)
    assert adapter_of(model) is loaded
    with loaded.gate(ids == mask_id):
        assert torch.equal(_logits(model, ids), expected)


def test_detach_gives_the_original_back(model_and_adapter):
    model, adapter, mask_id = model_and_adapter
    ids = torch.randint(0, 100, (1, 6))
    before = _logits(model, ids)
    adapter.attach(model)
    adapter.detach(model)
    assert torch.equal(_logits(model, ids), before)
    assert "mars_adapter" not in dict(model.named_modules())


def test_a_second_adapter_is_refused(model_and_adapter):
    from marslm.errors import UserError

    model, adapter, mask_id = model_and_adapter
    adapter.attach(model)
    with pytest.raises(UserError, match="already"):
        MaskAdapter.for_model(model, mask_id, rank=2, rows=1).attach(model)


def test_decoding_fast_path_equals_the_general_path(model_and_adapter):
    """A decoding step's masks are each row's last columns: without autograd the update is added to
    that slice in place; it must give what the gather/scatter path (taken under autograd) gives."""
    model, adapter, mask_id = model_and_adapter
    adapter.attach(model)
    ids = torch.cat([torch.randint(0, 100, (2, 7)), torch.full((2, 4), mask_id)], dim=1)
    fast = _gated(adapter, model, ids, mask_id)
    with torch.enable_grad():
        general = _gated(adapter, model, ids, mask_id, grad=True)
    torch.testing.assert_close(fast, general, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast[:, :7], general[:, :7])


def test_fast_path_follows_weights_changed_in_place(model_and_adapter):
    """The factors the fast path keeps are rebuilt when an optimizer step changes the weights."""
    model, adapter, mask_id = model_and_adapter
    adapter.attach(model)
    ids = torch.cat([torch.randint(0, 100, (1, 5)), torch.full((1, 3), mask_id)], dim=1)
    before = _gated(adapter, model, ids, mask_id)
    with torch.no_grad():
        for lora in adapter.lora:
            lora.b.mul_(2.0)
    after = _gated(adapter, model, ids, mask_id)
    with torch.enable_grad():
        general = _gated(adapter, model, ids, mask_id, grad=True)
    assert not torch.allclose(after[:, 5:], before[:, 5:])
    torch.testing.assert_close(after, general, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "rows, tail",
    [
        ([[0, 0, 1, 1], [0, 0, 1, 1]], 2),  # a decoding step: every row ends in the same masks
        ([[0, 1, 0, 1], [0, 0, 1, 1]], 0),  # a mask before a clean token
        ([[0, 0, 0, 1], [0, 0, 1, 1]], 0),  # rows with different mask counts
        ([[0, 0, 0, 0], [0, 0, 0, 0]], 0),  # no masks
        ([[1, 1, 1, 1]], 4),
    ],
)
def test_trailing_masks(rows, tail):
    assert adapter_mod._trailing_masks(torch.tensor(rows, dtype=torch.bool)) == tail


def test_masks_between_clean_tokens_take_the_general_path_without_autograd(model_and_adapter):
    """The probe's layout: masks inside the row, not at its end; without autograd it must still
    touch the masks alone (the slice fast path would move every position)."""
    model, adapter, mask_id = model_and_adapter
    ids = torch.randint(0, 100, (2, 10))
    ids[:, 3:5] = mask_id
    original = _logits(model, torch.where(ids == mask_id, 0, ids))
    adapter.attach(model)
    out = _gated(adapter, model, ids, mask_id)
    assert torch.equal(out[:, :3], original[:, :3])
    with torch.enable_grad():
        general = _gated(adapter, model, ids, mask_id, grad=True)
    assert torch.equal(out, general)


@pytest.mark.parametrize("groups, per_group", [(1, 3), (2, 3), (3, 2)])
def test_the_tail_gate_is_the_placed_gate_of_a_decoding_step(model_and_adapter, groups, per_group):
    """A decoding step's masks are every row's last columns (``tail_gate``, which reads nothing off
    the data): the same outputs, to the last bit of float64, as the gate that finds the masks and
    reads their offsets off the attention mask, each group's offsets counted from 0."""
    model, adapter, mask_id = model_and_adapter
    model, adapter = model.double(), adapter.double()
    adapter.attach(model)
    real, masks = 4, groups * per_group
    ids = torch.cat([torch.randint(4, 100, (2, real)), torch.full((2, masks), mask_id)], dim=1)
    causal = torch.ones(real + masks, real + masks, dtype=torch.bool).tril()
    for g in range(groups):  # a group sees the real tokens and itself, not the other groups
        start = real + g * per_group
        causal[start:, real:start] = False
    mask = for_attention(causal.expand(2, 1, -1, -1), model)
    placed = torch.arange(real + masks) >= real
    with torch.no_grad(), adapter.gate(placed.expand(2, -1)):
        found = model(input_ids=ids, attention_mask=mask).logits
    offsets = torch.arange(per_group).repeat(groups)
    with torch.no_grad(), adapter.tail_gate(offsets):
        tail = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(tail[:, :real], found[:, :real])
    torch.testing.assert_close(tail, found, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        ungated = model(input_ids=ids.clamp(max=mask_id - 1), attention_mask=mask).logits
    assert not torch.allclose(tail[:, real:], ungated[:, real:])  # the adapter acted at the masks
