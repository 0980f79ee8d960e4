"""``marslm.generate``: the Python entry point to MARS decoding."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..chat import encode_prompt, stop_token_ids
from ..errors import UserError
from .batch import DecodeBatch
from .block_cache import BlockCachedBatch
from .params import ADAPTIVE_WIDTH, CACHE_MODES, DecodingParams, check_mask_batch_limit
from .rows import BatchStats, FinishedRow
from .text import TextStream


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]  # new tokens per prompt, EOS excluded
    forwards: list[int]  # forwards each prompt took part in
    accepted_per_step: list[list[int]]  # tokens accepted by each of those forwards
    stats: BatchStats = field(default_factory=BatchStats)

    @property
    def tokens_per_forward(self) -> float:
        """Decoded tokens (stop tokens included) per forward, over all prompts."""
        forwards = sum(self.forwards)
        return sum(map(sum, self.accepted_per_step)) / forwards if forwards else 0.0

    @property
    def batch_forwards(self) -> int:
        return self.stats.forwards


def run_to_completion(
    batch: DecodeBatch,
    prompt_ids: list[list[int]],
    params: list[DecodingParams],
    max_batch: int | None = None,
    streams: dict | None = None,
    on_finish=None,
) -> list[FinishedRow]:
    """Decode every prompt, keeping at most ``max_batch`` rows in flight; results in input order.

    ``streams`` (prompt index -> :class:`TextStream`) end their rows as soon as a stop string shows.
    """
    max_batch = max_batch or len(prompt_ids)
    streams = streams or {}
    waiting = list(range(len(prompt_ids)))
    finished: dict[int, FinishedRow] = {}

    def done(row: FinishedRow) -> None:
        if row.error is not None:  # offline, one failed prompt fails the call (the engine fails the request alone)
            raise RuntimeError(f"decoding prompt {row.request_id} failed: {row.error}")
        finished[row.request_id] = row
        if on_finish is not None:
            on_finish(row)

    while waiting or len(batch):
        free = max_batch - len(batch)
        if free > 0 and waiting:
            joining, waiting = waiting[:free], waiting[free:]
            batch.add([prompt_ids[i] for i in joining], [params[i] for i in joining], joining)
        for row in batch.step():
            done(row)
        if streams:
            hit = [rid for rid, ids in batch.new_tokens().items() if rid in streams and _push(streams[rid], ids)]
            for row in batch.stop(hit):
                done(row)
    return [finished[i] for i in range(len(prompt_ids))]


def _push(stream: TextStream, ids: list[int]) -> bool:
    stream.push(ids)
    return stream.stopped


def run_static_batches(
    batch: BlockCachedBatch,
    prompt_ids: list[list[int]],
    params: DecodingParams,
    batch_size: int | None = None,
    on_finish=None,
) -> list[FinishedRow]:
    """Decode ``batch_size`` prompts at a time, each group to its end (the block cache cannot refill)."""
    batch_size = batch_size or len(prompt_ids)
    rows: list[FinishedRow] = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start : start + batch_size]
        for row in batch.run(chunk, params, list(range(start, start + len(chunk)))):
            rows.append(row)
            if on_finish is not None:
                on_finish(row)
    return rows


def generate(
    model,
    tokenizer,
    prompts,
    *,
    tau: float = 1.0,
    block_size: int | None = None,
    metric: str = "prob",
    max_new_tokens: int = 256,
    apply_chat_template: bool = True,
    cache: str = "cursor",
    mode: str = "threshold",
    block_cache_size: int = 16,
    use_last_mask: bool = True,
    draft_groups: bool = False,
    adaptive_width: bool = ADAPTIVE_WIDTH,
    mask_batch_limit: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop=(),
    mask_token_id: int | None = None,
    batch_size: int | None = None,
    on_finish=None,
) -> GenerationResult:
    """Decode ``prompts`` (strings, message lists or token-id lists) with the MARS sliding window.

    ``tau`` >= 1 (prob/margin) is one-token mode and equals greedy AR decoding. ``block_size`` and
    the mask token default to what the checkpoint's ``marslm.json`` records.

    ``cache``: ``cursor`` (each row commits every step), ``block`` (the paper's block-level cache:
    blocks of ``block_cache_size`` masks filled left to right and committed in lockstep, static
    batches, greedy threshold mode) or ``none`` (recompute everything).
    ``mode="lossless"`` ignores tau: the masks draft, the next forward verifies, and the output is
    the AR model's: greedy token for token, or at ``temperature`` > 0 sampled exactly from its
    distribution (speculative sampling). ``draft_groups`` adds one mask group per possible
    accepted-draft count. ``use_last_mask`` (default) also reads the last mask, whose prediction is
    B+1 tokens ahead: training teaches exactly that case. ``adaptive_width`` (off by default: every
    step reads its masks, as the paper's sampler does) rests a row from masks while its recent steps
    accepted none; at tau < 1 that changes the text, not only the reach (batch.py). ``mask_batch_limit``: while more
    rows than this decode together, none reads masks (plain AR steps; batch.py says when it pays).

    ``temperature``, ``top_p``, ``top_k``: sampling (threshold mode samples the AR token of each
    step; the masks keep the tau rule). ``seed``: prompt i samples with seed ``seed + i``, so its
    answer does not depend on the other prompts. ``stop``: up to 4 strings; an answer ends before
    the first one it produces, which is not part of its text.

    ``batch_size`` caps the rows decoded together (default: all prompts at once); finished rows
    are replaced by waiting prompts between steps. ``on_finish(row)`` is called as rows finish.
    """
    from ..modeling import checkpoint_facts

    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        raise UserError("prompts must be a list (of strings, message lists or token-id lists)")
    facts = checkpoint_facts(model, tokenizer, mask_token_id)
    params = DecodingParams(
        tau=tau,
        metric=metric,
        block_size=block_size or facts.block_size,
        max_new_tokens=max_new_tokens,
        mode=mode,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
    ).verify()
    if cache not in CACHE_MODES:
        raise UserError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
    if facts.mask_token_id is None and not params.one_token:
        raise UserError(
            "the tokenizer has no mask token (<|mask|>); is this a MARS checkpoint? "
            "Only tau = 1 (plain AR decoding) works without one"
        )
    if cache == "block" and (mode != "threshold" or temperature > 0 or params.stop):
        raise UserError("the block cache decodes greedily in threshold mode, without stop strings; use cache='cursor'")
    if block_cache_size < 1:
        raise UserError(f"block_cache_size must be >= 1, got {block_cache_size}")
    check_mask_batch_limit(mask_batch_limit, "mask_batch_limit")

    prompt_ids = [encode_prompt(tokenizer, p, apply_chat_template) for p in prompts]
    per_prompt = [replace(params, seed=None if seed is None else seed + i) for i in range(len(prompts))]
    common = dict(
        mask_token_id=facts.mask_token_id if facts.mask_token_id is not None else facts.pad_id,
        pad_id=facts.pad_id,
        stop_ids=stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
    )
    streams = {i: TextStream(tokenizer, params.stop) for i in range(len(prompts))} if params.stop else {}
    if cache == "block":
        batch = BlockCachedBatch(model, block_cache_size=block_cache_size, **common)
        rows = run_static_batches(batch, prompt_ids, params, batch_size, on_finish)
    else:
        batch = DecodeBatch(
            model,
            cache=cache,
            use_last_mask=use_last_mask,
            draft_groups=draft_groups,
            adaptive_width=adaptive_width,
            mask_batch_limit=mask_batch_limit,
            **common,
        )
        rows = run_to_completion(
            batch, prompt_ids, per_prompt, max_batch=batch_size, streams=streams, on_finish=on_finish
        )
    texts, token_ids = [], []
    for i, row in enumerate(rows):
        if i in streams:
            stream = streams[i]
            stream.push(row.token_ids[len(stream.ids) :])
            stream.finish()
            texts.append(stream.text)
            token_ids.append(row.token_ids[: stream.token_count()])
        else:
            texts.append(tokenizer.decode(row.token_ids, skip_special_tokens=True))
            token_ids.append(row.token_ids)
    return GenerationResult(
        texts=texts,
        token_ids=token_ids,
        forwards=[r.forwards for r in rows],
        accepted_per_step=[r.accepted_per_step for r in rows],
        stats=batch.stats,
    )
