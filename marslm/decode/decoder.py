"""The interface every decoder answers, and the one place that picks a decoder for a run.

A decoder holds running rows (requests) and advances all of them with one forward per step:

    add(prompts, settings, request_ids)   rows join, between steps (``settings`` verified)
    step() -> [FinishedRow]               one forward for every running row; the rows that ended
    new_tokens() -> {request id: tokens}  what running rows accepted in that step (streaming, stop strings)
    stop(request_ids) -> [FinishedRow]    end rows now, with their tokens so far (a stop string matched)
    cancel(request_ids)                   drop rows (a client went away)
    set_tau(request_ids, tau)             a new tau for running rows, from their next step
    len(decoder), stats                   running rows; forwards and the rest of ``BatchStats``

and says when rows may join (:func:`free_rows`). Four decoders implement it, each built by
:func:`make_decoder`:

    DecodeBatch       batch.py        rows that advance independently (continuous batching): every
                                      mode (a mode is a rule in rules.py), the cursor cache or none,
                                      eager or compiled
    BlockCachedBatch  block_cache.py  the paper's block cache: blocks committed in lockstep, so
                                      rows join an empty batch only
    DraftedBatch      draft_model.py  a separate draft model, which keeps one row's cache: one row
    JacobiBatch       jacobi_batch.py Jacobi decoding of a plain AR model, the paper's baseline: one row

``generate`` (generation.py) and the server's engine (serve/engine.py) drive each of them with
the same loop: admit what :func:`free_rows` allows, step, publish ``new_tokens``, match stop strings.
"""

from __future__ import annotations

from typing import Protocol

from .params import DecoderOptions
from .rows import BatchStats, FinishedRow


class Decoder(Protocol):
    stats: BatchStats
    joins_running: bool  # rows may join while others run (else only an empty decoder)
    max_rows: int | None  # the most rows it holds (None: as many as it is given)
    mask_batch_limit: int | None  # above this many rows no row reads masks (None: no limit)

    def __len__(self) -> int: ...
    def add(self, prompts: list[list[int]], settings: list, request_ids: list) -> None: ...
    def step(self) -> list[FinishedRow]: ...
    def new_tokens(self) -> dict: ...
    def stop(self, request_ids) -> list[FinishedRow]: ...
    def cancel(self, request_ids) -> None: ...
    def set_tau(self, request_ids, tau: float) -> None: ...


def free_rows(decoder: Decoder, capacity: int) -> int:
    """How many rows may join ``decoder`` now, with at most ``capacity`` running."""
    if len(decoder) and not decoder.joins_running:
        return 0
    return max(min(capacity, decoder.max_rows or capacity) - len(decoder), 0)


def make_decoder(
    model,
    options: DecoderOptions,
    *,
    stop_ids,
    mask_token_id: int | None = None,
    pad_id: int | None = None,
    seed=None,
    drafting: tuple | None = None,
    jacobi_window: int | None = None,
    max_len: int | None = None,
    most_rows: int | None = None,
    work: int | None = None,
):
    """The decoder ``options`` call for, ending rows at ``stop_ids``; the masked decoders feed
    ``mask_token_id`` and pad with ``pad_id``. ``drafting``, ``(a checked drafter, drafts per step,
    the target's mask token or None for an AR target)``, decodes with a draft model;
    ``jacobi_window`` by Jacobi iteration; ``cache="block"`` with the paper's block cache; else a
    ``DecodeBatch`` (``max_len``: its longest row and ``most_rows`` its most rows, where known up
    front, which size a compiled step's cache; ``work``: the tokens the call may decode, None for a server, which
    ``compile="auto"`` reads)."""
    if drafting is not None:
        from .draft_model import DraftedBatch

        return DraftedBatch.of(model, drafting, stop_ids=stop_ids, use_last_mask=options.use_last_mask, seed=seed)
    if jacobi_window is not None:
        from .jacobi_batch import JacobiBatch

        return JacobiBatch(model, jacobi_window, stop_ids)
    if options.cache == "block":
        from .block_cache import BlockCachedBatch

        return BlockCachedBatch(
            model,
            mask_token_id=mask_token_id,
            stop_ids=stop_ids,
            pad_id=pad_id,
            block_cache_size=options.block_cache_size,
        )
    from .batch import DecodeBatch

    facts = dict(mask_token_id=mask_token_id, pad_id=pad_id, stop_ids=stop_ids, seed=seed)
    return DecodeBatch.with_options(model, options, max_len, work, most_rows, **facts)
