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
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .decode.params import ADAPTIVE_WIDTH
from .errors import UserError
from .files import read_json, write_json_atomically

# Entropy is a different scale from probabilities: accept while H <= tau, in nats; 0 is one-token
# mode, and a confident prediction has H well below 0.5.
ENTROPY_TAUS = (0.0, 0.25, 0.5, 1.0)
EVAL_SOURCES = "toy, reworded, gsm8k:PATH, humaneval:PATH, or a GSM8K/HumanEval-format JSONL path"


@dataclass
class EvalSet:
    name: str
    examples: list  # objects with .messages and .family
    score_many: Callable[[list, list[str]], list[bool]]


def load_eval_set(source: str, n: int = 500, seed: int = 0) -> EvalSet:
    """``toy`` (the embedded suite's test split), ``reworded`` (its arithmetic and lists worded as the
    training data never does), ``gsm8k:PATH``, ``humaneval:PATH``, or a path whose first record
    tells the format (GSM8K: question/answer; HumanEval: task_id/prompt/test/entry_point).

    Files give their first ``n`` records in file order; ``seed`` applies to ``toy`` and ``reworded``.
    """
    from .sandbox import require_isolation

    if source == "toy":
        from .data import toy

        require_isolation()  # its code family runs model-written code: refuse now, not after decoding
        return EvalSet("toy", toy.make_split("test", n, seed=seed), toy.score_many)
    if source == "reworded":  # off-distribution: toy arithmetic and lists, worded as training never does
        from .data import reworded, toy

        return EvalSet("reworded", reworded.make_split(n, seed=seed), toy.score_many)
    kind, _, path = source.partition(":")
    if kind not in ("gsm8k", "humaneval") or not path:
        kind, path = _detect_eval_format(source), source
    if kind == "gsm8k":
        from .data import gsm8k

        return EvalSet(source, gsm8k.load_gsm8k(path, n), gsm8k.score_many)
    from .data import humaneval

    require_isolation()

    return EvalSet(source, humaneval.load_humaneval(path, n), humaneval.score_many)


def _detect_eval_format(path: str) -> str:
    from .data import gsm8k, humaneval
    from .data.jsonl import first_record

    if not Path(path).is_file():
        raise UserError(f"unknown evaluation data {path!r} (use {EVAL_SOURCES})")
    keys = set(first_record(path))
    if set(humaneval.KEYS) <= keys:
        return "humaneval"
    if set(gsm8k.KEYS) <= keys:
        return "gsm8k"
    raise UserError(
        f"{path}: not a GSM8K (question, answer) or HumanEval (task_id, prompt, test, entry_point) "
        f"file; its first record has keys {sorted(keys)}"
    )


def evaluate(
    model,
    tokenizer,
    eval_set: EvalSet,
    *,
    taus=(1.0,),
    metric: str = "prob",
    block_size: int | None = None,
    cache: str = "cursor",
    mode: str = "threshold",
    batch_size: int = 32,
    max_new_tokens: int = 192,
    use_last_mask: bool = True,
    adaptive_width: bool = ADAPTIVE_WIDTH,
    progress: bool = True,
    model_name: str | None = None,
) -> dict:
    """``{"model", "data", "results": [one entry per tau]}``; see :func:`summarise_result` for an entry."""
    from tqdm.auto import tqdm

    from .decode import generate

    prompts = [ex.messages for ex in eval_set.examples]
    results = []
    for tau in taus:
        bar = tqdm(total=len(prompts), desc=f"eval tau={tau}", unit="ans", disable=not progress, leave=False)
        started = time.perf_counter()
        out = generate(
            model,
            tokenizer,
            prompts,
            tau=tau,
            metric=metric,
            block_size=block_size,
            cache=cache,
            mode=mode,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            use_last_mask=use_last_mask,
            adaptive_width=adaptive_width,
            on_finish=lambda _row, bar=bar: bar.update(1),
        )
        seconds = time.perf_counter() - started
        bar.close()
        correct = eval_set.score_many(eval_set.examples, out.texts)
        entry = summarise_result(eval_set.examples, correct, out.accepted_per_step, seconds)
        entry.update(
            tau=tau,
            metric=metric,
            block_size=block_size,
            cache=cache,
            mode=mode,
            use_last_mask=use_last_mask,
            adaptive_width=adaptive_width,
        )
        results.append(entry)
    return {"model": model_name or getattr(model, "name_or_path", ""), "data": eval_set.name, "results": results}


def summarise_result(examples, correct, accepted_per_step, seconds) -> dict:
    """One result entry: accuracy, speed and per-family numbers for one decoding setting.

    ``correct`` and ``accepted_per_step`` (tokens accepted at each forward) align with ``examples``.
    """
    by_family = defaultdict(lambda: {"correct": 0, "n": 0, "tokens": 0, "forwards": 0})
    for ex, ok, steps in zip(examples, correct, accepted_per_step):
        fam = by_family[ex.family]
        fam["correct"] += bool(ok)
        fam["n"] += 1
        fam["tokens"] += sum(steps)
        fam["forwards"] += len(steps)
    tokens = sum(map(sum, accepted_per_step))
    forwards = sum(map(len, accepted_per_step))
    return {
        "accuracy": sum(map(bool, correct)) / len(examples),
        "n": len(examples),
        "tokens_per_forward": tokens / forwards,
        "forwards_per_answer": forwards / len(examples),
        "tokens_per_second": tokens / seconds if seconds else None,
        "seconds": round(seconds, 2),
        "families": {
            name: {"accuracy": f["correct"] / f["n"], "n": f["n"], "tokens_per_forward": f["tokens"] / f["forwards"]}
            for name, f in sorted(by_family.items())
        },
        "correct": [int(bool(ok)) for ok in correct],  # per item, in order: for paired comparisons
    }


def paired_bootstrap(
    correct_a: list[int], correct_b: list[int], *, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Interval of accuracy(a) - accuracy(b), in points, resampling the same items for both.

    Two settings scored on the same items are compared item by item, so the interval shows how
    much of a difference the choice of test items alone could make.
    """
    import random

    if len(correct_a) != len(correct_b) or not correct_a:
        raise ValueError("paired_bootstrap needs two equally long, non-empty lists")
    rng = random.Random(seed)
    n = len(correct_a)
    diffs = [a - b for a, b in zip(correct_a, correct_b)]
    means = sorted(100 * sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


# ---------------------------------------------------------------------------- sweeps


def is_one_token(cell: dict) -> bool:
    """Whether a setting is plain greedy AR decoding (prob/margin tau >= 1, entropy tau <= 0)."""
    if cell.get("mode", "threshold") != "threshold":
        return False
    return cell["tau"] <= 0 if cell.get("metric") == "entropy" else cell["tau"] >= 1


def _checkpoint_facts(model: str) -> tuple[str | None, int | None]:
    """(stage, trained block size) from the checkpoint's marslm.json; (None, None) if it has none."""
    from .config import MarsConfig

    config = MarsConfig.load(model) if Path(model).is_dir() else None
    return (config.stage, config.block_size) if config else (None, None)


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
) -> list[dict]:
    """The decoding settings a sweep runs for one model, in order.

    An AR SFT checkpoint (stage "ar") gets one cell, one-token mode: it has no trained masks to
    read, and it is the baseline the MARS curves are measured against. Lossless mode ignores tau,
    so it gets one cell per block size. A MARS checkpoint gets every (block size, metric, tau);
    the entropy metric takes its taus from ``entropy_taus``, the others from ``taus``.
    """
    common = {"cache": cache, "adaptive_width": adaptive_width}
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


SETTING_KEYS = ("tau", "metric", "block_size", "cache", "mode", "adaptive_width")
DATA_KEYS = ("model", "data", "data_n", "data_seed")


def _setting_key(cell: dict) -> tuple:
    return tuple(cell.get(k) for k in SETTING_KEYS)


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


def sweep(
    models: list[str],
    data: str = "toy",
    *,
    n: int = 500,
    seed: int = 0,
    taus=(1.0, 0.95, 0.9),
    entropy_taus=ENTROPY_TAUS,
    metrics=("prob",),
    block_sizes=None,
    cache: str = "cursor",
    mode: str = "threshold",
    adaptive_width: bool = ADAPTIVE_WIDTH,
    batch_size: int = 32,
    max_new_tokens: int = 192,
    json_path: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
    device: str | None = "auto",
) -> dict:
    """Evaluate every model at every setting of :func:`plan_cells`; return the report (see module doc).

    With ``json_path`` the report is rewritten (atomically) after every cell, and a rerun skips
    the cells already there: a cell is identified by (model, data, n, seed, tau, metric,
    block_size, cache, mode, adaptive_width). A cell that raises (out of memory, say) is recorded as
    ``{..setting.., "failed": "<reason>"}`` and the sweep goes on; a rerun tries it again.
    One-token cells of a model are decoded once and shared: whatever the block size or metric,
    their output is greedy AR decoding.
    """
    from .decode import DecodingParams, ParamError, check_tau
    from .modeling import check_model_source, load_model, resolve_device

    for flag, value in (("--batch-size", batch_size), ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    device = resolve_device(device)
    eval_set = load_eval_set(data, n, seed=seed)
    for model in models:
        check_model_source(model)
    for metric in metrics:
        for tau in entropy_taus if metric == "entropy" else taus:
            check_tau(tau, metric)
    if any(b < 1 for b in block_sizes or ()):
        raise UserError(f"block sizes must be >= 1, got {list(block_sizes)}")

    reports = _load_previous(json_path) if resume else []
    by_key = {data_key(rep): rep for rep in reports}
    plans = []
    for model in models:
        stage, trained_block = _checkpoint_facts(model)
        key = (model, data, n, seed)
        if key not in by_key:
            by_key[key] = {
                "model": model,
                "data": data,
                "data_n": n,
                "data_seed": seed,
                "stage": stage,
                "trained_block_size": trained_block,
                "results": [],
            }
            reports.append(by_key[key])
        report = by_key[key]
        cells = plan_cells(
            stage,
            trained_block,
            taus=taus,
            entropy_taus=entropy_taus,
            metrics=metrics,
            block_sizes=block_sizes,
            cache=cache,
            mode=mode,
            adaptive_width=adaptive_width,
        )
        for cell in cells:  # what generate and serve check, before any model loads
            settings = {k: cell[k] for k in ("tau", "metric", "block_size", "mode")}
            try:
                DecodingParams(**settings, max_new_tokens=max_new_tokens).verify(trained_block)
            except ParamError as exc:
                raise UserError(f"{model}: {exc}") from None
        plans.append((report, cells))

    total = sum(len(cells) for _, cells in plans)
    done_count = 0
    for report, cells in plans:
        finished = {_setting_key(c): c for c in report["results"] if "failed" not in c}
        loaded = None
        for cell in cells:
            done_count += 1
            if _setting_key(cell) in finished:
                continue
            shared = None
            if is_one_token(cell):
                shared = next((c for c in finished.values() if is_one_token(c) and c["cache"] == cell["cache"]), None)
            if shared is not None:
                origin = shared.get("shared_with") or {k: shared[k] for k in SETTING_KEYS}
                entry = {**shared, **cell, "shared_with": origin}
            else:
                if loaded is None:
                    loaded = load_model(report["model"], device=device)[:2]
                entry = _run_cell(loaded, eval_set, cell, report["model"], batch_size, max_new_tokens, progress)
            if "failed" not in entry:
                finished[_setting_key(cell)] = entry
            _store(report, entry)
            if progress:
                _say_cell(done_count, total, report["model"], entry)
            if json_path is not None:
                write_json_atomically(json_path, sweep_payload(reports))
        del loaded
        gc.collect()
    payload = sweep_payload(reports)
    if json_path is not None:
        write_json_atomically(json_path, payload)
    return payload


def _run_cell(
    loaded, eval_set: EvalSet, cell: dict, model_name: str, batch_size: int, max_new_tokens: int, progress: bool
) -> dict:
    model, tokenizer = loaded
    try:
        report = evaluate(
            model,
            tokenizer,
            eval_set,
            taus=(cell["tau"],),
            metric=cell["metric"],
            block_size=cell["block_size"],
            cache=cell["cache"],
            mode=cell["mode"],
            adaptive_width=cell["adaptive_width"],
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            progress=progress,
            model_name=model_name,
        )
    except Exception as exc:  # noqa: BLE001 - one bad cell (OOM, a model without masks) must not end a long sweep
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


# ---------------------------------------------------------------------------- tables


def format_table(reports: dict[str, dict]) -> str:
    """A markdown table: one row per (model, setting), accuracy per family, tokens per forward.

    Block size, metric, mode and adaptive width get columns only when they vary; a failed cell
    shows its reason.
    """
    cells = [r for rep in reports.values() for r in rep["results"]]
    families = sorted({f for r in cells for f in r.get("families", {})})
    varying = [k for k in ("block_size", "metric", "mode", "adaptive_width") if len({r.get(k) for r in cells}) > 1]
    names = {"block_size": "B", "adaptive_width": "adaptive width"}
    head = [
        "model",
        *[names.get(k, k) for k in varying],
        "tau",
        "accuracy",
        *families,
        "tok/fwd",
        "fwd/answer",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rep in reports.items():
        for r in rep["results"]:
            cells_out = [label, *[str(r.get(k)) for k in varying], f"{r['tau']:g}"]
            if "failed" in r:
                cells_out += [f"failed: {r['failed']}"] + ["-"] * (len(head) - len(cells_out) - 1)
            else:
                cells_out.append(f"{100 * r['accuracy']:.1f}")
                cells_out += [
                    f"{100 * r['families'][f]['accuracy']:.1f}" if f in r["families"] else "-" for f in families
                ]
                cells_out += [f"{r['tokens_per_forward']:.2f}", f"{r['forwards_per_answer']:.1f}"]
            lines.append("| " + " | ".join(cells_out) + " |")
    return "\n".join(lines)


def labelled(reports: list[dict]) -> dict[str, dict]:
    """Model reports keyed by a display label: the model name, plus the data where that repeats."""
    names = [rep.get("model", "") for rep in reports]
    out = {}
    for rep in reports:
        label = rep.get("model", "")
        if names.count(label) > 1:
            label = f"{label} ({rep.get('data')}, n={rep.get('data_n')}, seed={rep.get('data_seed')})"
        out[label] = rep
    return out


def format_markdown(payload: dict, title: str = "marslm evaluation") -> str:
    """A small markdown document for a sweep report: the data, then the table."""
    reports = model_reports(payload)
    data = sorted(
        {f"{rep.get('data')} (n={rep.get('data_n', '?')}, seed={rep.get('data_seed', '?')})" for rep in reports}
    )
    return (
        f"# {title}\n\nData: {', '.join(data)}. Accuracy in percent; tok/fwd = decoded tokens per "
        f"forward pass; fwd/answer = forward passes per answer.\n\n{format_table(labelled(reports))}\n"
    )
