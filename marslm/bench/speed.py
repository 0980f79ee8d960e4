"""``marslm bench``: wall-clock decoding speed, side by side, in one process.

Every contender decodes the same test prompts in static batches of the same size (HF
``generate`` cannot refill a batch, so neither do we here), after a warm-up, for several
repeats. Reported per contender and batch size: tokens/s (median, min, max), tokens per forward,
speed-up over the AR baseline (HF ``generate`` with KV cache on the AR checkpoint), accuracy of
the answers, and the peak KV-cache size.

Tokens are new tokens without the stop token. Tokens per forward for HF contenders counts model
calls with a forward hook: every row of a batch takes part in every call. With a separate drafter
(``--draft-model``), tokens per forward count the target's forwards and ``drafter_forwards`` the
drafter's; the drafter's time is inside the measured time.

The settings of a run, also those of ``--cost-curve`` and ``--train-step``, are a
:class:`BenchConfig` (bench_config.py), checked when it is made; the CLI builds it from its options.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..chat import encode_prompt
from ..decode import generate
from ..decode.params import DecodingParams
from .config import DRAFTER_GROUPS, BenchConfig
from .contenders import Contender, default_contenders
from .report import HF_COMPILED, PAPER_REFERENCE, check_targets


class _ForwardCounter:
    """Counts a model's forwards. The count is a tensor, so that a compiled forward (HF generate's
    static+compile, which traces the hooks) adds to it instead of specialising on its value."""

    def __init__(self, model):
        self.count = torch.zeros((), dtype=torch.long, device=model.device)
        self.handle = model.register_forward_hook(self._hook)

    @property
    def calls(self) -> int:
        return int(self.count)

    def _hook(self, *_):
        self.count.add_(1)

    def close(self):
        self.handle.remove()


def _kv_bytes_per_slot(model) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize


def _run_hf(model, tokenizer, prompt_ids, batch_size, max_new_tokens, options: dict, pad_to: int = 0) -> dict:
    """HF generate over ``prompt_ids`` in batches, each left-padded to its longest prompt or to
    ``pad_to`` (a compiled static cache then keeps one shape)."""
    assistant = options.get("assistant_model")
    if (options.get("prompt_lookup_num_tokens") or assistant is not None) and batch_size > 1:
        return {"refused": "HF assisted/prompt-lookup decoding supports batch size 1 only"}
    pad = tokenizer.pad_token_id
    counter = _ForwardCounter(model)
    drafter = _ForwardCounter(assistant) if assistant is not None else None
    token_ids, row_forwards, peak_slots = [], 0, 0
    try:
        for start in range(0, len(prompt_ids), batch_size):
            chunk = prompt_ids[start : start + batch_size]
            width = max(pad_to, *map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
            attn = (
                torch.arange(width, device=model.device)[None]
                >= (width - torch.tensor([len(p) for p in chunk], device=model.device))[:, None]
            ).long()
            calls_before = counter.calls
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    **options,
                )
            row_forwards += (counter.calls - calls_before) * len(chunk)
            peak_slots = max(peak_slots, out.shape[1])
            for row in out[:, width:].tolist():
                stop = [i for i, t in enumerate(row) if t in (tokenizer.eos_token_id, pad)]
                token_ids.append(row[: stop[0]] if stop else row)
    finally:
        counter.close()
        if drafter is not None:
            drafter.close()
    tokens = sum(map(len, token_ids))
    return {
        "token_ids": token_ids,
        "tokens": tokens,
        "tokens_per_forward": (tokens + len(token_ids)) / row_forwards,
        "kv_slots": peak_slots * batch_size,
        **({"drafter_forwards": drafter.calls} if drafter is not None else {}),
    }


def _run_mars(model, tokenizer, prompt_ids, batch_size, c: Contender, drafting: dict) -> dict:
    """``drafting``: generate's drafter keywords, for a drafted contender."""
    token_ids, accepted, peak_slots, drafter_forwards, compile_seconds = [], [], 0, 0, 0.0
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start : start + batch_size]
        out = generate(model, tokenizer, chunk, params=c.params, decoder=c.decoder, batch_size=batch_size, **drafting)
        token_ids += out.token_ids
        accepted += out.accepted_per_step
        drafter_forwards += out.stats.drafter_forwards
        compile_seconds += out.stats.compile_seconds
        width = out.stats.peak_cache_slots or max(map(len, chunk)) + c.params.max_new_tokens
        peak_slots = max(peak_slots, width)
    tokens = sum(map(len, token_ids))
    return {
        "token_ids": token_ids,
        "tokens": tokens,
        "tokens_per_forward": sum(map(sum, accepted)) / sum(map(len, accepted)),
        "kv_slots": peak_slots * batch_size if c.decoder.cache != "none" else 0,
        "compile_seconds": compile_seconds,
        **({"drafter_forwards": drafter_forwards} if drafting else {}),
    }


def run_bench(models: dict, eval_set, config: BenchConfig) -> dict:
    """``models``: ``{"ar": (model, tokenizer), "mars": (model, tokenizer)}`` (:func:`load_bench_models`).

    Per batch size, every contender is warmed up, then the repeats go round the contenders in turn
    (interleaved), so a machine that slows down for a while slows every contender alike.
    """
    from tqdm.auto import tqdm

    contenders = [c for c in default_contenders(config) if c.checkpoint in models]
    if "drafter" not in models:
        contenders = [c for c in contenders if c.kind not in ("draft", "hf-assisted")]
    examples = eval_set.examples[: config.n]
    prompts = {
        name: [encode_prompt(models[name][1], ex.messages) for ex in examples]
        for name in ("ar", "mars")
        if name in models
    }
    rows = []
    rounds = len(config.batch_sizes) * len(contenders) * (config.repeats + 1)
    bar = tqdm(total=rounds, desc="bench", disable=not config.progress)
    for batch_size in config.batch_sizes:
        results, seconds = _timed_rounds(models, prompts, contenders, batch_size, config, bar)
        for c in contenders:
            rows.append(_row(c, batch_size, results[c.name], seconds[c.name], models, eval_set, examples))
    bar.close()
    _add_speedups(rows)
    _mark_identical_outputs(rows)
    for row in rows:
        row.pop("token_ids", None)
    report = {
        "data": eval_set.name,
        "n": len(examples),
        "repeats": config.repeats,
        "max_new_tokens": config.max_new_tokens,
        "device": str(next(iter(models.values()))[0].device),
        "dtype": str(next(iter(models.values()))[0].dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "paper_reference": PAPER_REFERENCE,
        "rows": rows,
    }
    if "drafter" in models:
        report["draft_model"] = config.drafting.draft_model
    report["targets"] = check_targets(report)
    return report


def _timed_rounds(models, prompts, contenders, batch_size, config: BenchConfig, bar):
    """Each contender's result and the seconds of each repeat, after a warm-up round on one batch;
    the repeats go round the contenders in turn."""
    seconds = {c.name: [] for c in contenders}
    results, compile_seconds = {}, {}
    for round_ in range(config.repeats + 1):  # round 0 is the warm-up, on one batch
        for c in contenders:
            model, tokenizer = models[c.checkpoint]
            if "refused" in results.get(c.name, {}):
                bar.update(1)
                continue
            # HF's compiled step compiles in the warm-up, on every prompt: its compile time is not reported
            hf_compiled = c.kind == "hf" and c.options.get("compile")
            every = prompts[c.checkpoint]
            prompt_ids = every[:batch_size] if round_ == 0 and not hf_compiled else every
            started = time.perf_counter()
            if c.kind in ("mars", "draft"):
                result = _run_mars(model, tokenizer, prompt_ids, batch_size, c, _drafting(c, models))
            else:
                keywords, pad_to = _hf_keywords(c, models), max(map(len, every)) if hf_compiled else 0
                result = _run_hf(model, tokenizer, prompt_ids, batch_size, config.max_new_tokens, keywords, pad_to)
            # a bucket compiles the first time a step meets it, warm-up or not: reported, never timed
            paid = result.pop("compile_seconds", 0.0)
            compile_seconds[c.name] = compile_seconds.get(c.name, 0.0) + paid
            if round_ or "refused" in result:
                seconds[c.name].append(time.perf_counter() - started - paid)
                results[c.name] = result
            bar.update(1)
    for name, paid in compile_seconds.items():
        if paid and name in results:
            results[name]["compile_seconds"] = round(paid, 2)
    return results, seconds


def _drafting(c: Contender, models: dict) -> dict:
    """generate's drafter keywords for a drafted contender (none for the others). The drafter's
    tokenizer was checked once when it loaded, so no call spends timed work on it."""
    if c.kind != "draft":
        return {}
    keep = ("num_draft_tokens", "draft_tau")
    return {"draft_model": models["drafter"][0], **{k: v for k, v in c.options.items() if k in keep}}


def _hf_keywords(c: Contender, models: dict) -> dict:
    """HF generate's keywords. Assisted generation reads K, its schedule and its confidence cut-off
    from the assistant's generation config, so they go there. Compiled, HF generate runs its
    static cache and compiles its decoding step (fullgraph, static shapes), on any device."""
    if c.options.get("compile"):
        from transformers.generation.configuration_utils import CompileConfig

        from ..decode.forward import BACKEND

        config = CompileConfig(fullgraph=True, dynamic=False, backend=BACKEND, mode="default")
        config._compile_all_devices = True  # transformers compiles on GPUs alone unless told
        return {"cache_implementation": "static", "compile_config": config}
    if c.kind != "hf-assisted":
        return c.options
    drafter = models["drafter"][0]
    drafter.generation_config.update(**c.options)
    return {"assistant_model": drafter}


def _row(c: Contender, batch_size: int, result: dict, seconds: list[float], models, eval_set, examples) -> dict:
    """One contender's report row at one batch size."""
    model, tokenizer = models[c.checkpoint]
    row = {"contender": c.name, "batch_size": batch_size, "options": c.options, "checkpoint": c.checkpoint}
    if "refused" in result:
        return {**row, "refused": result["refused"]}
    if "drafter_forwards" in result:  # per pass over the prompts, as tokens_per_forward's forwards
        row["drafter_forwards"] = result["drafter_forwards"]
    if c.kind == "draft" and batch_size > 1:
        row["note"] = "marslm's drafter decodes the rows of a batch one after another"
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in result["token_ids"]]
    correct = eval_set.score_many(examples, texts)
    rates = [result["tokens"] / s for s in seconds]
    return {
        **row,
        "tokens": result["tokens"],
        "tokens_per_second": statistics.median(rates),
        "tokens_per_second_min": min(rates),
        "tokens_per_second_max": max(rates),
        "tokens_per_forward": result["tokens_per_forward"],
        "accuracy": sum(correct) / len(correct),
        "peak_kv_mib": result["kv_slots"] * _kv_bytes_per_slot(model) / 2**20,
        "token_ids": result["token_ids"],
        **({"compile_seconds": result["compile_seconds"]} if "compile_seconds" in result else {}),
    }


def _add_speedups(rows) -> None:
    """Each row's speed-up over HF generate on the AR checkpoint at the same batch size, and where
    HF generate ran compiled too (``--compile``), over that (``speedup_vs_hf_compiled``)."""
    for row in rows:
        for baseline, key in (("HF generate (AR ckpt)", "speedup"), (HF_COMPILED, "speedup_vs_hf_compiled")):
            base = next(
                (
                    r
                    for r in rows
                    if r["batch_size"] == row["batch_size"] and r["contender"] == baseline and "tokens_per_second" in r
                ),
                None,
            )
            if base and "tokens_per_second" in row:
                row[key] = row["tokens_per_second"] / base["tokens_per_second"]


def _mark_identical_outputs(rows) -> None:
    """Flag contenders whose output equals greedy AR on the same checkpoint (the lossless claim)."""
    for row in rows:
        ref = next(
            (
                r
                for r in rows
                if r["batch_size"] == row["batch_size"]
                and r.get("token_ids") is not None
                and r["contender"] == f"HF generate ({row['checkpoint'].upper()} ckpt)"
            ),
            None,
        )
        if ref is not None and row.get("token_ids") is not None:
            row["same_as_greedy"] = row["token_ids"] == ref["token_ids"]


def load_bench_models(config: BenchConfig) -> dict:
    """``{"mars": (model, tokenizer), "ar": (model, tokenizer)}`` from ``config.model`` and
    ``config.ar_model``, and ``"drafter"`` from ``--draft-model`` where a contender group uses it."""
    from ..modeling import (
        check_model_source,
        load_model,
        model_context,
        resolve_device,
        saved_config,
        trained_block_size,
        warn_untrained_masks,
    )

    drafter = config.drafting.draft_model if set(config.contenders) & set(DRAFTER_GROUPS) else None
    for path in (config.model, config.ar_model):  # every refusal before the first model loads
        check_model_source(path)
        DecodingParams(max_new_tokens=config.max_new_tokens).validate(context=model_context(path))
    saved = saved_config(config.model)
    # --block-size against what the checkpoint was trained with: generate's line, before anything loads
    DecodingParams(block_size=config.block_size).validate(trained_block_size(saved))
    if drafter is not None:
        check_model_source(drafter)
    if saved is not None and saved.stage == "ar":
        warn_untrained_masks(config.model, "every MARS contender at tau < 1")
    models = {}
    for name, path in (("mars", config.model), ("ar", config.ar_model)):
        model, tokenizer, _ = load_model(path, dtype=config.dtype, device=resolve_device(config.device))
        models[name] = (model, tokenizer)
    if drafter is not None:
        models["drafter"] = _load_drafter(config, models)
    return models


def _load_drafter(config: BenchConfig, models: dict) -> tuple:
    """The drafter and its tokenizer, refused (generate's line) unless it shares each target's vocabulary."""
    from ..decode.draft_model import check_drafter_vocabulary
    from ..modeling import checkpoint_facts

    loaded = config.drafting.load(config.device, config.dtype)
    drafter = (loaded["draft_model"], loaded["draft_tokenizer"])
    for target in models.values():
        check_drafter_vocabulary(target, drafter, checkpoint_facts(*target).mask_token_id)
    return drafter
