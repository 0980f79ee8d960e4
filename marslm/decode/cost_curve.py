"""What a forward costs against the tokens it feeds: one cached forward timed per width, batch size
and context (``marslm bench --cost-curve`` prints it; costs.py turns it into a cost table)."""

from __future__ import annotations

import statistics
import time

import torch

from ..adapter import adapter_of, placed_masks


def cost_curve(
    model,
    *,
    widths,
    contexts=(128, 512),
    batch_sizes=(1,),
    repeats: int = 5,
    seed: int = 0,
    progress: bool = True,
    compile: bool = False,
    capacity: int | None = None,
    reserve: int = 0,
    profile=(),
) -> dict:
    """Time of one cached forward against the number of tokens it feeds, as ratios to one token:
    whether masks pay on a machine. Per batch size and context a cache is prefilled with ``context``
    random tokens, then every width is fed on top of it and cropped back, the widths interleaved in
    each repeat, after a warm-up round. Every fed column's logits are computed, as a step reads
    them; on an exact-mode model the columns after the first are masks, so the adapter costs what
    it does in a step. ``compile``: the compiled decoder's step (forward.py) over a static cache of
    ``capacity`` slots (its buffers ``reserve`` rows, at least the batch's), traced in the warm-up
    round. ``profile``: widths then run ``repeats`` times
    more under ``torch.profiler`` (first batch size and context; :func:`_profiled`).
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    adapter = adapter_of(model)
    mask_id = None if adapter is None else adapter.spec.mask_token_id
    rows, profiles = [], {}
    if compile:
        from .forward import static_capacity

        static = dict(capacity=capacity or static_capacity(max(contexts) + max(widths)), reserve=reserve)
    bar = tqdm(
        total=len(batch_sizes) * len(contexts) * (repeats + 1) * len(widths), desc="cost curve", disable=not progress
    )
    for batch in batch_sizes:
        for context in contexts:
            args = (model, batch, context, widths, repeats, generator, mask_id, bar.update, () if profiles else profile)
            times, profiled = _timed_static_widths(*args, **static) if compile else _timed_widths(*args)
            profiles.update(
                {str(w): {"batch_size": batch, "context": context, "ops": ops} for w, ops in profiled.items()}
            )
            base = statistics.median(times[widths[0]])
            for w in widths:
                ms = statistics.median(times[w])
                rows.append({"batch_size": batch, "context": context, "width": w, "ms": 1000 * ms, "ratio": ms / base})
    bar.close()
    return {
        "model": getattr(model, "name_or_path", ""),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "compiled": compile,
        "widths": list(widths),
        "rows": rows,
        **({"profile": profiles} if profiles else {}),
    }


def _timed_widths(model, batch, context, widths, repeats, generator, mask_id, tick, profile=()):
    """Seconds of each width's forward over ``repeats`` rounds (after a warm-up round) on a cache of
    ``context`` random tokens; every column after the first is ``mask_id`` where given."""
    from transformers import DynamicCache

    device, vocab = next(model.parameters()).device, model.config.vocab_size
    cache = DynamicCache(config=model.config)
    prefix = torch.randint(vocab, (batch, context), generator=generator).to(device)
    with torch.no_grad():
        model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)

    def prepare(w):
        fed = torch.randint(vocab, (batch, w), generator=generator).to(device)
        placed = torch.zeros(batch, w, dtype=torch.bool)
        if mask_id is not None:
            fed[:, 1:], placed[:, 1:] = mask_id, True
        positions = (context + torch.arange(w, device=device)).expand(batch, -1)

        def forward():
            with torch.no_grad(), placed_masks(model, placed):
                model(input_ids=fed, position_ids=positions, cache=cache, use_cache=True)

        return forward

    return _timed_rounds(widths, repeats, device, prepare, lambda w: cache.crop(-w), tick, profile)


def _timed_static_widths(
    model, batch, context, widths, repeats, generator, mask_id, tick, profile=(), *, capacity, reserve=0
):
    """:func:`_timed_widths` for the compiled step: the same forwards through ``StepForward.run``
    over a static cache, with the mask always a tensor and the adapter's tail gate."""
    import numpy as np

    from .forward import Padded, StepForward
    from .kv import StaticSlotCache

    device, vocab = next(model.parameters()).device, model.config.vocab_size
    cache, step = StaticSlotCache(capacity, batch, device, reserve), StepForward(model, pad_id=0)

    def to_device(array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    def inputs(ids, start):
        w = ids.shape[1]
        mask = np.zeros((batch, 1, w, cache.window), bool)
        mask[:, 0, :, :start] = True
        mask[:, 0, :, start : start + w] = np.tril(np.ones((w, w), bool))
        positions = np.broadcast_to(start + np.arange(w), (batch, w)).copy()
        tail = w - 1 if mask_id is not None and start else 0
        return Padded(ids, positions, mask, tail, np.arange(tail))

    prefix = torch.randint(vocab, (batch, context), generator=generator).numpy()
    cache.prepare(batch, context, compiled=False)
    step.run(cache, inputs(prefix, 0), False, to_device)

    def prepare(w):
        fed = torch.randint(vocab, (batch, w), generator=generator).numpy()
        if mask_id is not None:
            fed[:, 1:] = mask_id
        cache.prepare(batch, w, compiled=True)
        return lambda: step.run(cache, inputs(fed, context), True, to_device)

    return _timed_rounds(widths, repeats, device, prepare, lambda w: cache.crop(-w), tick, profile)


def _timed_rounds(widths, repeats, device, prepare, crop, tick, profile=()):
    """``(seconds of each width's forward, the profile of each width in profile)``: each forward
    (``prepare(w)`` makes it) over ``repeats`` rounds after a warm-up round (where a compiled
    width compiles), the widths in turn within each round; the cache is cropped back after each."""
    times = {w: [] for w in widths}
    for round_ in range(repeats + 1):
        for w in widths:
            forward = prepare(w)
            _synchronize(device)
            started = time.perf_counter()
            forward()
            _synchronize(device)
            if round_:
                times[w].append(time.perf_counter() - started)
            crop(w)
            tick(1)
    return times, {w: _profiled(prepare, crop, w, device, repeats) for w in profile if w in times}


PROFILE_TOP = 12  # operators a profile keeps, costliest first


def _profiled(prepare, crop, w, device, repeats) -> list[dict]:
    """The costliest operators of ``repeats`` forwards of width ``w`` by their own (self) host time:
    per forward, how often each ran, its milliseconds and its share of the total (the inputs'
    making included). On a GPU each one's device time is kept too."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            prepare(w)()
            _synchronize(device)
            crop(w)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ops = []
    for e in events[:PROFILE_TOP]:
        name = "compiled graph (its fused kernels)" if e.key.startswith("## Call CompiledFxGraph") else e.key
        op = {"op": name, "calls": e.count / repeats, "ms": e.self_cpu_time_total / 1000 / repeats}
        op["share"] = e.self_cpu_time_total / total
        if device.type == "cuda":
            op["device_ms"] = getattr(e, "self_device_time_total", 0.0) / 1000 / repeats
        ops.append(op)
    return ops


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
