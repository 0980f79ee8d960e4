"""``marslm.generate``: the Python entry point to MARS decoding."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..chat import encode_prompt, stop_token_ids
from ..errors import UserError
from .draft_options import DRAFT_TOKENS
from .params import MAX_DRAFT_TOKENS, DecoderOptions, DecodingParams  # noqa: F401 - MAX_DRAFT_TOKENS: the CLI's
from .rows import BatchStats, FinishedRow
from .run_loop import RunLoop, make_run_loop
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
        return self.tokens_per_forward_of(range(len(self.forwards)))

    def tokens_per_forward_of(self, prompts) -> float:
        """Decoded tokens (stop tokens included) per forward, over the prompts indexed by ``prompts``."""
        prompts = list(prompts)
        forwards = sum(self.forwards[i] for i in prompts)
        return sum(sum(self.accepted_per_step[i]) for i in prompts) / forwards if forwards else 0.0

    @property
    def batch_forwards(self) -> int:
        return self.stats.forwards


def run_to_completion(
    loop: RunLoop,
    prompt_ids: list[list[int]],
    params: list[DecodingParams],
    max_batch: int | None = None,
    streams: dict | None = None,
    on_finish=None,
) -> list[FinishedRow]:
    """Decode every prompt through ``loop`` (run_loop.py: any decoder, its mask limit), keeping
    at most ``max_batch`` rows in flight, as many as the decoder lets join; results in input order.

    ``streams`` (prompt index -> :class:`TextStream`) end their rows as soon as a stop string shows.
    """
    max_batch = max_batch or len(prompt_ids)
    streams = streams or {}
    waiting = list(range(len(prompt_ids)))
    finished: dict[int, FinishedRow] = {}
    while waiting or len(loop):
        free = loop.free(max_batch)
        if free > 0 and waiting:
            joining, waiting = waiting[:free], waiting[free:]
            texts = [streams.get(i) for i in joining]
            loop.add([prompt_ids[i] for i in joining], [params[i] for i in joining], joining, texts)
        for row in loop.step()[1]:
            if row.error is not None:  # offline, one failed prompt fails the call (the engine fails the request alone)
                raise RuntimeError(f"decoding prompt {row.request_id} failed: {row.error}")
            finished[row.request_id] = row
            if on_finish is not None:
                on_finish(row)
    return [finished[i] for i in range(len(prompt_ids))]


def generate(
    model,
    tokenizer,
    prompts,
    params: DecodingParams | None = None,
    decoder: DecoderOptions | None = None,
    *,
    apply_chat_template: bool = True,
    batch_size: int | None = None,
    mask_token_id: int | None = None,
    on_finish=None,
    draft_model=None,
    num_draft_tokens: int | None = None,
    draft_tokenizer=None,
    draft_tau: float | None = None,
    **overrides,
) -> GenerationResult:
    """Decode ``prompts`` (strings, message lists or token-id lists) with the MARS sliding window.

    ``params`` (:class:`DecodingParams`) is how each prompt decodes; ``decoder``
    (:class:`DecoderOptions`) how the decoder runs. Keywords override a field of either:
    ``generate(model, tokenizer, prompts, tau=0.9, cache="none")``. The defaults are plain greedy AR
    decoding (tau 1) with the cursor cache; ``block_size`` defaults to the one the checkpoint's
    ``marslm.json`` records, and a larger one is refused, as the CLI and the server refuse it.

    ``mode="lossless"`` ignores tau: the masks draft, the next forward verifies, and the output is
    the AR model's (greedy, or at ``temperature`` > 0 exactly its distribution). Threshold mode at
    ``temperature`` > 0 samples the AR token of each step; the masks keep the tau rule. ``seed``:
    prompt i samples with seed ``seed + i``, so its answer does not depend on the other prompts.
    ``mode="hybrid"`` verifies as lossless does, then accepts the confident (tau) predictions of
    the masks after the kept drafts; it decodes greedily, and at tau 1 it is lossless.
    ``stop``: up to 4 strings; an answer ends before the first one it produces.

    ``batch_size`` caps the rows decoded together (default: all prompts at once); finished rows
    are replaced by waiting prompts between steps. ``on_finish(row)`` is called as rows finish.
    ``mask_token_id`` overrides the checkpoint's mask token.

    ``draft_model`` (an HF causal LM sharing the target's vocabulary: its output rows are checked
    against the target's, and ``draft_tokenizer``, if given, token by token) proposes
    ``num_draft_tokens`` (default 4) per step, which the model verifies, adding its confident masks under tau
    after them (draft_model.py; threshold mode, cursor cache; rows decode one at
    a time). An AR drafter drafts one token per forward; a MARS checkpoint (its marslm.json or its
    tokenizer names a mask token, and it is no AR stage) drafts its confident masks too, while their
    top-1 probability passes ``draft_tau`` (default ``DEFAULT_DRAFT_TAU``, 0.9; refused for an AR
    drafter).
    """

    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        raise UserError("prompts must be a list (of strings, message lists or token-id lists)")
    params, decoder = with_overrides(params or DecodingParams(), decoder or DecoderOptions(), overrides)
    drafting = _drafting(draft_model, draft_tokenizer, num_draft_tokens, draft_tau)
    params, facts, common, drafter = _checked(model, tokenizer, params, decoder, mask_token_id, drafting)
    prompt_ids = _encoded(model, tokenizer, prompts, params, facts, apply_chat_template)
    streams = {i: TextStream(tokenizer, params.stop) for i in range(len(prompts))} if params.stop else {}
    drafting = None if drafter is None else (drafter, drafting[2], facts.mask_token_id)  # None: an AR target
    batch, rows = _decode(model, prompt_ids, params, decoder, common, streams, batch_size, on_finish, drafting)
    return _result(tokenizer, rows, streams, batch.stats)


def _drafting(draft_model, draft_tokenizer, num_draft_tokens, draft_tau) -> tuple:
    """``(draft model, its tokenizer, drafts per step, draft tau)``; a drafter's setting without a
    drafter would do nothing, so it is refused."""
    if draft_model is None:
        given = {"num_draft_tokens": num_draft_tokens, "draft_tokenizer": draft_tokenizer, "draft_tau": draft_tau}
        idle = [name for name, value in given.items() if value is not None]
        if idle:
            raise UserError(f"{', '.join(idle)} would do nothing: no draft model was given")
    return (draft_model, draft_tokenizer, DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens, draft_tau)


def _encoded(model, tokenizer, prompts, params: DecodingParams, facts, apply_chat_template: bool) -> list[list[int]]:
    """Each prompt's token ids, checked: it and its answer fit the context, and where an adapter
    acts at the mask token (exact mode), it holds none."""
    from ..adapter import adapter_of
    from ..modeling import model_context

    gated = facts.mask_token_id if adapter_of(model) is not None else None
    prompt_ids = [encode_prompt(tokenizer, p, apply_chat_template) for p in prompts]
    for ids in prompt_ids:
        params.check_prompt(len(ids), model_context(model))
        params.check_prompt_ids(ids, gated)
    return prompt_ids


def _checked(model, tokenizer, params, decoder, mask_token_id, drafting):
    """``(params resolved against the checkpoint, its facts, the ids every decoder takes, the
    drafter or None)``, every setting checked before any prompt is encoded; ``drafting``: ``(draft
    model or None, its tokenizer or None, drafts per step, draft tau or None)``."""
    from ..modeling import checkpoint_facts, model_context

    facts = checkpoint_facts(model, tokenizer, mask_token_id)
    context = model_context(model)
    params = params.validate(facts.block_size, context)
    decoder.validate(params, context)
    params.check_mask_token(facts.mask_token_id is not None)
    drafter = None
    if drafting[0] is not None or drafting[3] is not None:
        from .draft_model import check_drafter

        drafter = check_drafter(params, decoder, (model, tokenizer), drafting, facts.mask_token_id)
    common = dict(
        mask_token_id=facts.mask_token_id if facts.mask_token_id is not None else facts.pad_id,
        pad_id=facts.pad_id,
        stop_ids=stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
    )
    return params, facts, common, drafter


def _decode(model, prompt_ids, params, decoder, common, streams, batch_size, on_finish, drafting):
    """``(decoder, rows)``: every prompt decoded by the decoder the settings call for."""
    if params.one_token:  # no step reads masks: there is no batch to limit
        decoder = replace(
            decoder, mask_batch_limit=None if decoder.mask_batch_limit == "auto" else decoder.mask_batch_limit
        )
    rows = min(batch_size or len(prompt_ids), len(prompt_ids))
    longest = max(map(len, prompt_ids)) + params.max_new_tokens
    work = len(prompt_ids) * params.max_new_tokens  # what compile="auto" weighs a compile against
    loop = make_run_loop(
        model, decoder, block_size=params.block_size, rows=rows, max_len=longest, work=work, drafting=drafting, **common
    )
    seed = params.seed
    per_prompt = [replace(params, seed=None if seed is None else seed + i) for i in range(len(prompt_ids))]
    return loop.decoder, run_to_completion(loop, prompt_ids, per_prompt, batch_size, streams, on_finish)


def _result(tokenizer, rows: list[FinishedRow], streams: dict, stats: BatchStats) -> GenerationResult:
    """Texts and token ids per prompt, a stop string's cut applied where one ended the row."""
    texts, token_ids = [], []
    for i, row in enumerate(rows):
        if i in streams:
            token_ids.append(streams[i].close(row.token_ids))
            texts.append(streams[i].text)
        else:
            token_ids.append(row.token_ids)
            texts.append(tokenizer.decode(row.token_ids, skip_special_tokens=True))
    return GenerationResult(
        texts=texts,
        token_ids=token_ids,
        forwards=[r.forwards for r in rows],
        accepted_per_step=[r.accepted_per_step for r in rows],
        stats=stats,
    )


def with_overrides(params: DecodingParams, decoder: DecoderOptions, overrides: dict):
    """``params`` and ``decoder`` with each keyword put into the one whose field it names."""
    request, run = ({f.name for f in fields(cls)} for cls in (DecodingParams, DecoderOptions))
    unknown = set(overrides) - request - run
    if unknown:
        raise TypeError(f"generate() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    params = replace(params, **{k: v for k, v in overrides.items() if k in request})
    decoder = replace(decoder, **{k: v for k, v in overrides.items() if k in run})
    return params, decoder
