"""Evaluation: accuracy per task family and tokens per forward, for each decoding setting.

An eval set is a list of examples (each with chat ``messages`` and a ``family``) and a scorer
that takes them with the model's responses. Decoding is batched with continuous refill, so a
long answer does not hold up a whole batch.

    evaluate(model, ...)   one loaded model, several taus      -> one model report
    sweep(models, ...)     models x block sizes x metrics x taus, resumable from its JSON file

A *model report* is ``{"model", "data", "results": [cell, ...]}``; a *cell* is one decoding
setting's numbers (see :func:`summarise_result`). :func:`sweep` writes a single model report as is,
and several as ``{"models": [model report, ...]}``.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..decode.draft_options import DraftOptions
from ..decode.params import (
    ADAPTIVE_WIDTH,
    CACHE_MODES,
    MASK_BATCH_LIMIT,
    METRICS,
    MODES,
    DecoderOptions,
    DecodingParams,
    check_tau,
)
from ..errors import UserError
from ..files import output_file, read_json, write_json_atomically
from ..settings import DTYPE_NAMES, check_count, flag_of, floats, ints, setting, strings
from .report import decoded_with, settings_of, summarise_result
from .sets import EVAL_SOURCES, EvalSet, load_eval_set

# Entropy is a different scale from probabilities: accept while H <= tau, in nats; 0 is one-token
# mode, and a confident prediction has H well below 0.5.
ENTROPY_TAUS = (0.0, 0.25, 0.5, 1.0)
EVAL_MAX_NEW_TOKENS = 192


@dataclass
class EvalConfig:
    """One sweep (:func:`sweep`); the ``marslm eval`` options are these fields (settings.py), and
    they are checked when it is made."""

    models: list = setting(help="checkpoint directories or hub ids", flag="--model", cli=False)
    data: str = setting("toy", f"evaluation data: {EVAL_SOURCES}")
    n: int = setting(500, "number of test items")
    seed: int = setting(0, "seed of the toy suite's test items")
    taus: list = setting(
        [1.0, 0.95, 0.9], "comma-separated taus for the prob and margin metrics", flag="--tau", parse=floats
    )
    entropy_taus: list = setting(
        list(ENTROPY_TAUS),
        "comma-separated entropy thresholds in nats for --metric entropy",
        flag="--entropy-tau",
        parse=floats,
    )
    metrics: list = setting(
        ["prob"], f"comma-separated confidence metrics from {','.join(METRICS)}", flag="--metric", parse=strings
    )
    block_sizes: list | None = setting(
        None,
        "comma-separated block sizes (masks per step; default: each checkpoint's trained B)",
        flag="--block-size",
        parse=ints,
    )
    cache: str = setting("cursor", "KV cache policy", choices=CACHE_MODES)
    mode: str = setting(
        "threshold",
        "threshold: MARS acceptance by tau; lossless: exact greedy output, tau ignored; hybrid: lossless, "
        "then tau on the masks after the verified drafts",
        choices=MODES,
    )
    adaptive_width: bool = setting(ADAPTIVE_WIDTH, "see DecoderOptions", cli=False)  # the CLI's --[no-]adaptive-width
    mask_batch_limit: int | str | None = setting(  # and --mask-batch-limit
        MASK_BATCH_LIMIT, "see DecoderOptions", cli=False
    )
    drafting: DraftOptions = setting(DraftOptions(), "a separate drafter", cli=False)  # the CLI's --draft-model
    # the CLI's --compile; not a cell's setting, as the text is the eager step's
    compile: bool | str = setting("auto", "see DecoderOptions", cli=False)
    dtype: str = setting("auto", "weights dtype (auto: as saved)", choices=DTYPE_NAMES, cli=False)  # the CLI's --dtype
    batch_size: int = setting(32, "rows decoded together")
    max_new_tokens: int = setting(EVAL_MAX_NEW_TOKENS, "longest answer, in tokens")
    device: str | None = setting("auto", "torch device", cli=False)  # the CLI's --device (common.py)
    json_path: str | None = setting(
        None, "write the report to FILE after every cell; resume from it", flag="--json", metavar="FILE"
    )
    resume: bool = setting(True, "with --json: start afresh, replacing FILE", negative="--no-resume")
    progress: bool = setting(True, "no progress bars or per-cell lines", negative="--quiet")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field in range, or one ``UserError`` line naming its flag."""

        def flag(name):
            return flag_of(EvalConfig, name)

        if self.json_path is not None:
            output_file(self.json_path, flag("json_path"))
        for metric in self.metrics:
            if metric not in METRICS:
                raise UserError(f"unknown metric {metric!r} in {flag('metrics')}; choose from {', '.join(METRICS)}")
        if (
            not self.models
            or not self.taus
            or not self.metrics
            or (self.block_sizes is not None and not self.block_sizes)
        ):
            raise UserError("--model, --tau, --metric and --block-size need at least one value each")
        for name in ("n", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("n", "batch_size"):
            check_count(flag(name), getattr(self, name))
        for metric in self.metrics:
            for tau in self.entropy_taus if metric == "entropy" else self.taus:
                check_tau(tau, metric)
        if any(b < 1 for b in self.block_sizes or ()):
            raise UserError(f"block sizes must be >= 1, got {list(self.block_sizes)}")
        for name, allowed in (("cache", CACHE_MODES), ("mode", MODES)):
            if getattr(self, name) not in allowed:
                raise UserError(f"{flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        fallback = dict(adaptive_width=self.adaptive_width, mask_batch_limit=self.mask_batch_limit)
        DecoderOptions(cache=self.cache, compile=self.compile, **fallback)  # checks them (--compile: cursor cache)


def evaluate(
    model,
    tokenizer,
    eval_set: EvalSet,
    *,
    taus=(1.0,),
    params: DecodingParams | None = None,
    decoder: DecoderOptions | None = None,
    batch_size: int = 32,
    progress: bool = True,
    model_name: str | None = None,
    drafting: dict | None = None,
    **overrides,
) -> dict:
    """``{"model", "data", "results": [one entry per tau]}``; see :func:`summarise_result` for an entry.

    ``params`` and ``decoder`` are how to decode (as :func:`marslm.generate` takes them, answers
    of at most ``EVAL_MAX_NEW_TOKENS`` by default); keywords override their fields, and ``taus``
    their tau. ``drafting``: ``generate``'s drafter keywords (``DraftOptions.load``).
    """
    from tqdm.auto import tqdm

    from ..decode import generate
    from ..decode.generation import with_overrides

    params = params or DecodingParams(max_new_tokens=EVAL_MAX_NEW_TOKENS)
    params, decoder = with_overrides(params, decoder or DecoderOptions(), overrides)
    prompts = [ex.messages for ex in eval_set.examples]
    results = []
    for tau in taus:
        bar = tqdm(total=len(prompts), desc=f"eval tau={tau}", unit="ans", disable=not progress, leave=False)
        started = time.perf_counter()
        out = generate(
            model,
            tokenizer,
            prompts,
            replace(params, tau=tau),
            decoder,
            batch_size=batch_size,
            on_finish=lambda _row, bar=bar: bar.update(1),
            **(drafting or {}),
        )
        seconds = time.perf_counter() - started
        bar.close()
        correct = eval_set.score_many(eval_set.examples, out.texts)
        entry = summarise_result(eval_set.examples, correct, out.accepted_per_step, seconds)
        entry.update(decoded_with(model, out.stats), tau=tau, **settings_of(params, decoder))
        if drafting:  # tokens per forward count the target's forwards; these are the drafter's
            entry["drafter_forwards"] = out.stats.drafter_forwards
        results.append(entry)
    return {"model": model_name or getattr(model, "name_or_path", ""), "data": eval_set.name, "results": results}


# ---------------------------------------------------------------------------- sweeps


def is_one_token(cell: dict) -> bool:
    """Whether a cell's setting is plain greedy AR decoding (decode.params.one_token)."""
    from ..decode.params import one_token

    return one_token(cell["tau"], cell.get("metric", "prob"), cell.get("mode", "threshold"))


def plan_cells(
    stage: str | None,
    trained_block: int | None,
    *,
    taus,
    entropy_taus,
    metrics,
    block_sizes,
    cache: str,
    mode: str,
    adaptive_width: bool = ADAPTIVE_WIDTH,
    mask_batch_limit: int | str | None = MASK_BATCH_LIMIT,
    drafting: DraftOptions | None = None,
    dtype: str = "auto",
) -> list[dict]:
    """The decoding settings a sweep runs for one model, in order.

    An AR SFT checkpoint (stage "ar") gets one cell, one-token mode: it has no trained masks to
    read, and it is the baseline the MARS curves are measured against. Lossless mode ignores tau,
    so it gets one cell per block size. A MARS checkpoint gets every (block size, metric, tau);
    the entropy metric takes its taus from ``entropy_taus``, the others from ``taus``. With a
    drafter every cell names it; in a dtype other than the saved one (``auto``), every cell names that.
    """
    common = {"cache": cache, "adaptive_width": adaptive_width, "mask_batch_limit": mask_batch_limit}
    common.update(drafting.recorded() if drafting else {})
    common.update({} if dtype == "auto" else {"dtype": dtype})
    if stage == "ar":
        return [{"tau": 1.0, "metric": "prob", "block_size": 1, "mode": "threshold", **common}]
    cells = []
    for block_size in block_sizes or [trained_block or 4]:
        if mode == "lossless":
            cells.append({"tau": 1.0, "metric": "prob", "block_size": block_size, "mode": mode, **common})
            continue
        for metric in metrics:
            for tau in entropy_taus if metric == "entropy" else taus:
                cells.append({"tau": tau, "metric": metric, "block_size": block_size, "mode": mode, **common})
    return cells


SETTING_KEYS = ("tau", "metric", "block_size", "cache", "mode", "adaptive_width", "mask_batch_limit", "dtype")
DRAFT_KEYS = tuple(f.name for f in fields(DraftOptions))  # a drafted cell's (DraftOptions.recorded)
DATA_KEYS = ("model", "data", "data_n", "data_seed")


def _setting_key(cell: dict) -> tuple:
    return tuple(cell.get(k) for k in SETTING_KEYS + DRAFT_KEYS)


def data_key(model_report: dict) -> tuple:
    return tuple(model_report.get(k) for k in DATA_KEYS)


def model_reports(payload, source: str = "report") -> list[dict]:
    """The model reports in an eval report (``{"model", "results"}``) or a sweep report (``{"models"}``)."""
    if isinstance(payload, dict) and isinstance(payload.get("models"), list):
        reports = payload["models"]
    elif isinstance(payload, dict) and "results" in payload:
        reports = [payload]
    else:
        raise UserError(f"{source} is not a marslm eval report (expected 'results' or 'models')")
    for rep in reports:
        if (
            not isinstance(rep, dict)
            or not isinstance(rep.get("results"), list)
            or not all(isinstance(cell, dict) for cell in rep["results"])
        ):
            raise UserError(f"{source} is not a marslm eval report (a model report lacks a 'results' list)")
    return reports


def sweep_payload(reports: list[dict]) -> dict:
    """What a sweep writes: one model report as is (the shape of ``marslm eval``), else ``{"models"}``."""
    return reports[0] if len(reports) == 1 else {"models": reports}


def _load_previous(json_path: str | Path | None) -> list[dict]:
    if json_path is None or not Path(json_path).exists():
        return []
    payload = read_json(json_path, hint="; cannot resume from it (remove it or pass --no-resume)")
    return model_reports(payload, f"{json_path} (to resume from)")


def _failure(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {lines[0]}" if lines else exc.__class__.__name__


def sweep(config: EvalConfig) -> dict:
    """Evaluate every model at every setting of :func:`plan_cells`; return the report (see module doc).

    With ``config.json_path`` the report is rewritten (atomically) after every cell, and a rerun
    skips the cells already there: a cell is identified by (model, data, n, seed, tau, metric,
    block_size, cache, mode, adaptive_width, mask_batch_limit, dtype, drafter). A cell that raises
    (out of memory, say) is recorded as ``{..setting.., "failed": "<reason>"}`` and the sweep goes
    on; a rerun tries it again. One-token cells of a model are decoded once and shared: whatever
    the block size or metric, their output is greedy AR decoding.
    """
    from ..modeling import load_model, resolve_device

    device = resolve_device(config.device)
    eval_set = load_eval_set(config.data, config.n, seed=config.seed)
    reports = _load_previous(config.json_path) if config.resume else []
    plans = _plan(config, reports)
    total, done_count, drafting = sum(len(cells) for _, cells in plans), 0, None
    for report, cells in plans:
        finished = {_setting_key(c): c for c in report["results"] if "failed" not in c}
        loaded = None
        for cell in cells:
            done_count += 1
            if _setting_key(cell) in finished:
                continue
            entry = _shared_entry(cell, finished)
            if entry is None:
                if loaded is None:
                    loaded = load_model(report["model"], dtype=config.dtype, device=device)[:2]
                    drafting = config.drafting.load(device) if drafting is None else drafting
                entry = _run_cell(loaded, eval_set, cell, report["model"], config, drafting)
            if "failed" not in entry:
                finished[_setting_key(cell)] = entry
            _store(report, entry)
            if config.progress:
                _say_cell(done_count, total, report["model"], entry)
            if config.json_path is not None:
                write_json_atomically(config.json_path, sweep_payload(reports))
        del loaded
        gc.collect()
    payload = sweep_payload(reports)
    if config.json_path is not None:
        write_json_atomically(config.json_path, payload)
    return payload


def _plan(config: EvalConfig, reports: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each model's report (found in ``reports`` or added to them) and its cells, every cell's
    settings checked against the checkpoint, as generate and serve check them, before any model loads."""
    from ..decode import ParamError
    from ..modeling import check_model_source, model_context, saved_config, saved_mask_token, trained_block_size

    drafter = config.drafting.draft_model
    for model in config.models + ([drafter] if drafter else []):
        check_model_source(model)
    by_key = {data_key(rep): rep for rep in reports}
    plans = []
    for model in config.models:
        saved = saved_config(model)
        stage, trained_block = (saved.stage if saved else None), trained_block_size(saved)
        key = (model, config.data, config.n, config.seed)
        if key not in by_key:
            by_key[key] = dict(zip(DATA_KEYS, key), stage=stage, trained_block_size=trained_block, results=[])
            reports.append(by_key[key])
        cells = plan_cells(
            stage,
            trained_block,
            taus=config.taus,
            entropy_taus=config.entropy_taus,
            metrics=config.metrics,
            block_sizes=config.block_sizes,
            cache=config.cache,
            mode=config.mode,
            adaptive_width=config.adaptive_width,
            mask_batch_limit=config.mask_batch_limit,
            drafting=config.drafting,
            dtype=config.dtype,
        )
        context, has_mask = model_context(model), None
        for cell in cells:
            settings = {k: cell[k] for k in ("tau", "metric", "block_size", "mode")}
            try:
                params = DecodingParams(**settings, max_new_tokens=config.max_new_tokens)
                params = params.validate(trained_block, context)
                if not params.one_token:
                    has_mask = saved_mask_token(model) if has_mask is None else has_mask
                    params.check_mask_token(has_mask)
            except ParamError as exc:
                raise UserError(f"{model}: {exc}") from None
        plans.append((by_key[key], cells))
    return plans


def _shared_entry(cell: dict, finished: dict) -> dict | None:
    """A one-token cell's entry from a finished one-token cell of the same model, cache, dtype and
    drafter, if any."""
    if not is_one_token(cell):
        return None
    same = ("cache", "dtype", *DRAFT_KEYS)
    shared = next(
        (c for c in finished.values() if is_one_token(c) and all(c.get(k) == cell.get(k) for k in same)), None
    )
    if shared is None:
        return None
    return {**shared, **cell, "shared_with": shared.get("shared_with") or {k: shared.get(k) for k in SETTING_KEYS}}


def _run_cell(loaded, eval_set: EvalSet, cell: dict, model_name: str, config: EvalConfig, drafting: dict) -> dict:
    model, tokenizer = loaded
    settings = {k: cell[k] for k in ("metric", "block_size", "mode")}
    try:
        report = evaluate(
            model,
            tokenizer,
            eval_set,
            taus=(cell["tau"],),
            params=DecodingParams(**settings, max_new_tokens=config.max_new_tokens),
            decoder=DecoderOptions(
                **{k: cell[k] for k in ("cache", "adaptive_width", "mask_batch_limit")},
                compile=config.compile,
            ),
            batch_size=config.batch_size,
            progress=config.progress,
            model_name=model_name,
            drafting=drafting,
        )
    except UserError:  # an input the model cannot take (a prompt past its context) fails every cell alike
        raise
    except Exception as exc:  # noqa: BLE001 - one bad cell (OOM, say) must not end a long sweep
        _free_accelerator_memory()
        return {**cell, "failed": _failure(exc)}
    return {**report["results"][0], **cell}


def _free_accelerator_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _store(report: dict, entry: dict) -> None:
    """Put a cell into its model report, replacing an earlier try of the same setting."""
    key = _setting_key(entry)
    for i, cell in enumerate(report["results"]):
        if _setting_key(cell) == key:
            report["results"][i] = entry
            return
    report["results"].append(entry)


def _say_cell(index: int, total: int, model: str, cell: dict) -> None:
    setting = f"B={cell['block_size']} {cell['metric']} tau={cell['tau']:g}" + (
        f" {cell['mode']}" if cell["mode"] != "threshold" else ""
    )
    if "failed" in cell:
        outcome = f"FAILED ({cell['failed']})"
    else:
        outcome = f"accuracy {100 * cell['accuracy']:.1f}%, {cell['tokens_per_forward']:.2f} tok/fwd"
    print(f"[{index}/{total}] {model} {setting}: {outcome}", file=sys.stderr, flush=True)
