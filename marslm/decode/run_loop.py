"""The one loop that drives a decoder: what ``marslm.generate`` and the server's engine both run.

Each turn:

    admit   rows join, as many as the decoder lets (decoder.free_rows)
    step    one forward for every running row, under the mask batch limit where one is set
            (costs.MaskBatchLimit: it sets the limit, steps, and learns what the masks bought)
    stop    rows whose text now holds a stop string end here (text.TextStream)

``generate`` runs turns until every prompt has finished; the engine runs one turn per pass of its
thread, between which requests arrive, leave and change tau. Neither steps a decoder by itself.
"""

from __future__ import annotations

from .costs import MaskBatchLimit, mask_limit
from .decoder import Decoder, free_rows, make_decoder
from .params import DecoderOptions
from .rows import FinishedRow


def make_run_loop(
    model,
    options: DecoderOptions,
    *,
    block_size: int,
    rows: int,
    max_len: int | None = None,
    work: int | None = None,
    drafting=None,
    **facts,
) -> RunLoop:
    """The decoder ``options`` call for (:func:`make_decoder`; ``facts``: its mask, pad and stop ids,
    a seed) in a loop, with ``mask_batch_limit="auto"``'s limit for up to ``rows`` rows of up to
    ``max_len`` tokens (costs.mask_limit: the cost table, measured on first need), where the
    decoder holds a batch to limit. The table used is named in the decoder's stats."""
    decoder = make_decoder(model, options, drafting=drafting, max_len=max_len, most_rows=rows, work=work, **facts)
    limit = None
    if options.mask_batch_limit == "auto" and drafting is None and options.cache != "block":
        limit = auto_mask_limit(model, decoder, block_size, rows)
        decoder.stats.cost_table = None if limit is None else limit.source
    return RunLoop(decoder, limit)


def auto_mask_limit(model, decoder, block_size: int, rows: int) -> MaskBatchLimit | None:
    """costs.mask_limit for the step ``decoder`` runs: compiled over its static cache, or eager."""
    static = getattr(decoder, "static", None) is not None
    shape = dict(capacity=decoder.capacity, reserve=decoder.reserve_rows) if static else {}
    return mask_limit(model, block_size, rows=rows, compiled=static, **shape)


class RunLoop:
    """One decoder (decoder.py), its mask batch limit (None: none, or a fixed one the decoder
    holds) and the stop-string matchers of the rows that have stop strings."""

    def __init__(self, decoder: Decoder, mask_limit: MaskBatchLimit | None = None):
        self.decoder = decoder
        self.mask_limit = mask_limit
        self.texts: dict = {}  # request id -> TextStream, for rows with stop strings

    def __len__(self) -> int:
        return len(self.decoder)

    def free(self, capacity: int) -> int:
        """How many rows may join now, with at most ``capacity`` running."""
        return free_rows(self.decoder, capacity)

    def add(self, prompts: list[list[int]], settings: list, request_ids: list, texts: list | None = None) -> None:
        """Rows join (``settings`` verified); ``texts``: each one's stop-string matcher or None.
        A row that cannot join raises before anything changes (the decoder's promise)."""
        self.decoder.add(prompts, settings, request_ids)
        for rid, text in zip(request_ids, texts or ()):
            if text is not None:
                self.texts[rid] = text

    def step(self) -> tuple[dict, list[FinishedRow]]:
        """One turn's forward: ``(tokens each running row accepted, the rows that ended)``; a row
        ended by a stop string is among the ended ones and not among the running ones."""
        decoder = self.decoder
        finished = decoder.step() if self.mask_limit is None else self.mask_limit.step(decoder)
        new_tokens = decoder.new_tokens()
        if self.texts:
            hit = [rid for rid, ids in new_tokens.items() if rid in self.texts and self.texts[rid].found_stop(ids)]
            finished += decoder.stop(hit)
            for rid in hit:
                del new_tokens[rid]
        for row in finished:
            self.texts.pop(row.request_id, None)
        return new_tokens, finished

    def cancel(self, request_ids) -> None:
        self.decoder.cancel(request_ids)
        for rid in request_ids:
            self.texts.pop(rid, None)

    def set_tau(self, request_ids, tau: float) -> None:
        self.decoder.set_tau(request_ids, tau)
