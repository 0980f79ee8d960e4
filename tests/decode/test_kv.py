"""SlotCache: rows persist in one buffer, so joining and leaving copy rows, not the cache."""

import torch

from marslm.decode.kv import SlotLayer


def _layer(rows: int, slots: int, capacity: int = 16) -> SlotLayer:
    layer = SlotLayer(capacity)
    keys = torch.arange(rows, dtype=torch.float32)[:, None, None, None].expand(rows, 2, slots, 4).clone()
    layer.update(keys, -keys)
    return layer


def test_leaving_rows_are_replaced_in_place():
    layer = _layer(rows=5, slots=3)
    storage = layer.keys.data_ptr(), layer.values.data_ptr()
    layer.batch_select_indices(torch.tensor([0, 4, 2]))
    keys, values = layer.update(torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4))
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == storage  # no new buffer
    assert keys.shape == (3, 2, 4, 4)
    assert keys[:, 0, 0, 0].tolist() == [0.0, 4.0, 2.0]
    assert values[:, 1, 2, 3].tolist() == [-0.0, -4.0, -2.0]


def test_joining_rows_take_free_rows_then_the_buffer_doubles():
    layer = _layer(rows=4, slots=2)
    layer.batch_select_indices(torch.tensor([0, 1]))
    storage = layer.keys.data_ptr()
    layer.add_rows(2)  # the two free rows
    assert layer.keys.data_ptr() == storage and layer.rows == 4
    keys, _ = layer.update(torch.ones(4, 2, 1, 4), torch.ones(4, 2, 1, 4))
    assert keys.shape == (4, 2, 3, 4) and keys[:2, 0, 0, 0].tolist() == [0.0, 1.0]
    layer.add_rows(1)  # none free: the buffer grows, the rows in use keep their slots
    assert layer.rows == 5 and layer.keys.shape[0] >= 8
    assert layer.keys[:4, 0, 2, 0].tolist() == [1.0] * 4


def test_compaction_keeps_each_rows_chosen_slots():
    layer = _layer(rows=2, slots=4)
    layer.keys[1, :, :4] = torch.arange(4, dtype=torch.float32)[None, :, None]
    layer.batch_select_indices(torch.tensor([1]))
    layer.gather_slots(torch.tensor([[3, 1]]))
    assert layer.length == 2 and layer.keys[0, 0, :2, 0].tolist() == [3.0, 1.0]


def test_a_compiled_step_attends_over_a_power_of_two_window_that_covers_its_slots():
    from marslm.decode.kv import MIN_WINDOW, window_for

    assert window_for(1, 512) == MIN_WINDOW
    assert [window_for(s, 512) for s in (64, 65, 128, 129, 300)] == [64, 128, 128, 256, 512]
    assert window_for(600, 512) == 512  # never past the buffers


def test_an_eager_step_attends_over_exactly_its_slots_and_a_compiled_one_over_a_window():
    from marslm.decode.kv import MIN_WINDOW, StaticSlotCache

    cache = StaticSlotCache(512, rows=2, device=torch.device("cpu"))
    cache.prepare(2, 48, compiled=False)  # a prompt's prefill: its layers are made by this forward
    keys, _ = cache.update(torch.ones(2, 2, 48, 4), torch.ones(2, 2, 48, 4), 0)
    assert keys.shape[2] == 48 and cache.capacity == 512  # the buffer is whole; the step reads its slots
    cache.advance(48)
    cache.prepare(2, 5, compiled=True)
    keys, _ = cache.update(torch.ones(2, 2, 5, 4), torch.ones(2, 2, 5, 4), 0)
    assert keys.shape[2] == MIN_WINDOW == 64  # 53 slots in use
    cache.advance(5)
    cache.prepare(2, 40, compiled=False)  # wider than any bucket: eager again, over its slots alone
    keys, _ = cache.update(torch.ones(2, 2, 40, 4), torch.ones(2, 2, 40, 4), 0)
    assert keys.shape[2] == 93
