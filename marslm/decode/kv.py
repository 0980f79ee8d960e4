"""A preallocated KV cache whose slots the decoding loop manages itself.

transformers' ``DynamicCache`` concatenates every new key/value onto the old ones, which copies the
whole cache at every step and every layer: a cost that grows with the cache and, with a batch of
long rows, dominates a small model's step. :class:`SlotCache` keeps one buffer per layer,
``[rows, kv_heads, capacity, head_dim]``, writes a step's keys/values into the next free slots and
hands attention a view of the used ones; dropping the masks' entries after a step only moves the
end back. The buffer doubles when it fills, so the copies amortise to nothing.

Slots are shared by all rows (a step appends the same number of slots to every row; a row that fed
less leaves holes that ``DecodeBatch.slot_valid`` masks out), so rows can join, leave and be
compacted with one indexing operation per layer.

Rows are persistent, as in vLLM's input batch: the buffer has room for more rows than run, a
joining row takes a free one and a leaving row's place is taken by a row from the end, so a
request that joins or leaves copies one row's used slots, not the whole cache. A free row keeps
whatever an earlier request left there; its slots are invalid to the row that takes it
(``slot_valid``), so attention never reads them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values in a buffer that grows by doubling, in slots and in rows; the
    first ``rows`` rows and ``length`` slots are in use."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.rows = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        rows, heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros(rows, heads, self.capacity, dim)
        self.values = value_states.new_zeros(rows, heads, self.capacity, value_states.shape[-1])
        self.rows = rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self._grow_slots(end)
        rows = self.rows
        self.keys[:rows, :, self.length : end] = key_states
        self.values[:rows, :, self.length : end] = value_states
        self.length = end
        return self.keys[:rows, :, :end], self.values[:rows, :, :end]

    def _grow_slots(self, needed: int) -> None:
        self.keys, self.values = (_grown(t, 2, max(needed, 2 * t.shape[2])) for t in (self.keys, self.values))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        self.length -= abs(tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (``[n]``), in that order, as rows ``0..n-1``; only rows whose place
        changes are copied, and only their used slots."""
        if not self.is_initialized:
            return
        n = len(indices)
        moved = torch.nonzero(indices != torch.arange(n, device=indices.device)).flatten()
        if len(moved):
            for buffer in (self.keys, self.values):
                buffer[moved, :, : self.length] = buffer[indices[moved], :, : self.length]
        self.rows = n

    def add_rows(self, count: int) -> None:
        """``count`` more rows at the end, in free rows of the buffer (it doubles when there are none)."""
        if not self.is_initialized:
            return
        needed = self.rows + count
        if needed > self.keys.shape[0]:
            self.keys, self.values = (_grown(t, 0, max(needed, 2 * t.shape[0])) for t in (self.keys, self.values))
        self.rows = needed

    def write_rows(self, rows: torch.Tensor, other: SlotLayer) -> None:
        """Copy ``other``'s slots into the first slots of ``rows``; the used slots grow to cover them."""
        width = other.length
        if width > self.length:
            if width > self.keys.shape[-2]:
                self._grow_slots(width)
            self.length = width
        self.keys[rows, :, :width] = other.keys[:, :, :width]
        self.values[rows, :, :width] = other.values[:, :, :width]

    def gather_slots(self, order: torch.Tensor) -> None:
        """Keep, per row, the slots ``order[row]`` (``[rows, n]``), moved to the front."""
        n = order.shape[1]
        if self.is_initialized:
            for buffer in (self.keys[: self.rows], self.values[: self.rows]):
                index = order[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])
                buffer[:, :, :n] = buffer[:, :, : self.length].gather(2, index)
        self.length = n


def _grown(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``size``."""
    shape = list(t.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


class SlotCache(Cache):
    """One :class:`SlotLayer` per model layer, created as the model first writes to them."""

    def __init__(self, capacity: int = 256):
        super().__init__(layer_class_to_replicate=lambda: SlotLayer(capacity))

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def select_rows(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def add_rows(self, count: int) -> None:
        for layer in self.layers:
            layer.add_rows(count)

    def gather_slots(self, order: torch.Tensor) -> None:
        for layer in self.layers:
            layer.gather_slots(order)

    def write_rows(self, rows: torch.Tensor, other: SlotCache) -> None:
        """Put ``other``'s keys/values (one cache per joining row) into ``rows`` of this one."""
        for layer, source in zip(self.layers, other.layers):
            layer.write_rows(rows, source)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if len(self.layers) > layer_idx else 0


class StaticSlotLayer(SlotLayer):
    """A :class:`SlotLayer` whose buffers keep their shape from step to step, as a compiled step
    needs: a forward writes its keys/values at the slots from ``start`` (a tensor the host sets, so
    a traced step does not specialise on it) and attends over the first ``window`` slots (a power
    of two the host sets, :func:`window_for`), the attention mask hiding those not in use. The host
    moves ``length`` itself (:meth:`StaticSlotCache.advance`); rows, holes, cropping and compaction
    are the :class:`SlotLayer`'s own."""

    def __init__(self, capacity: int, rows: int, start: torch.Tensor, window: int, reserve: int = 0):
        super().__init__(capacity)
        self.rows, self.start, self.window, self.reserve = rows, start, window, reserve

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = self.rows  # a step may feed padding rows past the ones in use
        super().lazy_initialization(key_states, value_states)
        if self.reserve > self.keys.shape[0]:  # the buffers' rows are graph inputs' shapes: fixed from the start
            self.keys, self.values = (_grown(t, 0, self.reserve) for t in (self.keys, self.values))
        self.rows = rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        fed = len(key_states)
        at = self.start + torch.arange(key_states.shape[-2], device=key_states.device)
        self.keys[:fed].index_copy_(2, at, key_states)
        self.values[:fed].index_copy_(2, at, value_states)
        return self.keys[:fed, :, : self.window], self.values[:fed, :, : self.window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window, 0

    def ensure(self, rows: int, slots: int) -> None:
        """Room for a step that feeds ``rows`` rows (padding included) into ``slots`` slots from
        ``length``: buffers that grow change the step's shape, so they grow rarely, by doubling."""
        if not self.is_initialized:
            self.capacity = max(self.capacity, slots)
            return
        if rows > self.keys.shape[0]:
            self.keys, self.values = (_grown(t, 0, max(rows, 2 * t.shape[0])) for t in (self.keys, self.values))
        if slots > self.keys.shape[2]:
            self._grow_slots(slots)
        self.capacity = self.keys.shape[2]


MIN_WINDOW = 64  # the fewest slots a compiled step attends over


def window_for(slots: int, capacity: int) -> int:
    """The slots a step that needs ``slots`` attends over: a power of two, so that a run meets a
    few windows (a graph each) and no step attends over much more of the cache than it uses."""
    return min(capacity, max(MIN_WINDOW, 1 << (slots - 1).bit_length()))


class StaticSlotCache(SlotCache):
    """One :class:`StaticSlotLayer` per model layer, all writing at one shared ``start``; its
    buffers hold ``reserve`` rows from the first forward (the most a decoder pads its steps to), so
    that their shape, which a compiled step's graph is traced for, never changes while rows come
    and go."""

    def __init__(self, capacity: int, rows: int, device: torch.device, reserve: int = 0):
        self.start = torch.zeros((), dtype=torch.long, device=device)
        Cache.__init__(self, layer_class_to_replicate=self._layer)
        self.capacity, self.rows, self.window, self.reserve = capacity, rows, capacity, reserve

    def _layer(self) -> StaticSlotLayer:
        return StaticSlotLayer(self.capacity, self.rows, self.start, self.window, self.reserve)

    @property
    def ready(self) -> bool:
        """Its buffers exist (the first forward, run eagerly, makes them): a compiled step may run."""
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    def prepare(self, rows: int, width: int, *, compiled: bool) -> None:
        """Before a forward of ``rows`` x ``width`` (padding included): room for it, its slots'
        start set to the first free one, and the slots it attends over (``window``): a bucket's
        window for a compiled step, exactly those in use for an eager one (a prompt's prefill
        attends over its own tokens, not over the whole buffer)."""
        length = self.get_seq_length()
        for layer in self.layers:
            layer.ensure(rows, length + width)
        self.capacity = self.layers[0].capacity if self.layers else max(self.capacity, length + width)
        self.window = window_for(length + width, self.capacity) if compiled else length + width
        for layer in self.layers:
            layer.window = self.window
        self.start.fill_(length)

    def advance(self, width: int) -> None:
        """After a forward: its ``width`` slots are in use (a commit crops what it does not keep)."""
        for layer in self.layers:
            layer.length += width

    def add_rows(self, count: int) -> None:
        self.rows += count
        super().add_rows(count)

    def select_rows(self, indices: torch.Tensor) -> None:
        self.rows = len(indices)
        super().select_rows(indices)
