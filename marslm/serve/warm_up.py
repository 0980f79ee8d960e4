"""Before a server says it is ready: throw-away rows decoded, so that no request pays for the first
call of a kernel or, where the step compiles, for a graph."""

from __future__ import annotations

import logging
import time

from ..decode import DecodingParams
from ..decode.decoder import Decoder
from ..decode.run_loop import RunLoop

log = logging.getLogger("marslm.engine")

WARM_UP_PROMPT = 8  # tokens of each warm-up row's prompt
WARM_UP_TOKENS = 24  # tokens each row of a compiled step's warm-up decodes, in each mode


def warm_up(new_decoder, max_batch: int, pad_id: int, block_size: int | None, progress: bool = True) -> None:
    """Decode throw-away rows before the server says it is ready. An eager step needs one short
    row (the allocator's and the kernels' first-call work); a compiled one (forward.py) decodes rows
    at each batch size its batches are padded to (1, 2, 4 .. ``max_batch``) in plain, threshold and
    lossless steps, so that the graphs requests meet are built, or loaded from the cache, here."""
    from ..decode.forward import row_bucket

    decoder = new_decoder()
    if getattr(decoder, "static", None) is None:
        decode_rows(decoder, 1, pad_id, DecodingParams(tau=0.5, block_size=block_size, max_new_tokens=2))
        return
    sizes = sorted({row_bucket(n) for n in range(1, max_batch + 1)})
    modes = [dict(tau=1.0), dict(tau=0.5)] + ([dict(mode="lossless")] if (block_size or 0) >= 2 else [])
    from tqdm.auto import tqdm

    started, compiling = time.perf_counter(), 0.0
    runs = [
        (rows, DecodingParams(block_size=block_size, max_new_tokens=WARM_UP_TOKENS, **m))
        for rows in sizes
        for m in modes
    ]
    for rows, params in tqdm(runs, desc="compiling the decoding step (batch sizes x modes)", disable=not progress):
        decoder = new_decoder()
        decode_rows(decoder, rows, pad_id, params)
        compiling += decoder.static.compile_seconds
    log.info(
        "warm-up: the compiled step's graphs for batches of %s rows are ready in %.0f s (%.0f s compiling)",
        ", ".join(map(str, sizes)),
        time.perf_counter() - started,
        compiling,
    )


def decode_rows(decoder: Decoder, rows: int, pad_id: int, params: DecodingParams) -> None:
    loop, settings = RunLoop(decoder), params.validate()
    loop.add([[pad_id] * WARM_UP_PROMPT] * rows, [settings] * rows, [f"warm-up-{i}" for i in range(rows)])
    while len(loop):
        loop.step()
