"""Evaluation numbers: one decoding setting's summary, paired intervals, and the markdown table."""

from __future__ import annotations

from collections import defaultdict


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


def format_table(reports: dict[str, dict]) -> str:
    """A markdown table: one row per (model, setting), accuracy per family, tokens per forward.

    Block size, metric, mode, adaptive width and the mask batch limit get columns only when they vary, the drafter and
    its K whenever a cell has one (tokens per forward are then the target's); a failed cell shows
    its reason.
    """
    cells = [r for rep in reports.values() for r in rep["results"]]
    families = sorted({f for r in cells for f in r.get("families", {})})
    varying = [
        k
        for k in ("block_size", "metric", "mode", "adaptive_width", "mask_batch_limit")
        if len({r.get(k) for r in cells}) > 1
    ]
    varying += [k for k in ("draft_model", "num_draft_tokens") if any(r.get(k) for r in cells)]
    names = {
        "block_size": "B",
        "adaptive_width": "adaptive width",
        "mask_batch_limit": "mask limit",
        "draft_model": "drafter",
        "num_draft_tokens": "K",
    }
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
            cells_out = [label, *["-" if r.get(k) is None else str(r[k]) for k in varying], f"{r['tau']:g}"]
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


def format_markdown(reports: list[dict], title: str = "marslm evaluation") -> str:
    """A small markdown document for a sweep's model reports: the data, then the table."""
    data = sorted(
        {f"{rep.get('data')} (n={rep.get('data_n', '?')}, seed={rep.get('data_seed', '?')})" for rep in reports}
    )
    return (
        f"# {title}\n\nData: {', '.join(data)}. Accuracy in percent; tok/fwd = decoded tokens per "
        f"forward pass; fwd/answer = forward passes per answer.\n\n{format_table(labelled(reports))}\n"
    )


def decoded_with(model, stats) -> dict:
    """What a cell decoded with beyond its settings, so that a number quoted from it carries them."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"decoded_dtype": dtype, "compiled": stats.compiled, "cost_table": stats.cost_table}


def settings_of(params, decoder) -> dict:
    """The settings an evaluation entry records beside its tau (``DecodingParams``, ``DecoderOptions``)."""
    request = {k: getattr(params, k) for k in ("metric", "block_size", "mode")}
    return request | {k: getattr(decoder, k) for k in ("cache", "use_last_mask", "adaptive_width", "mask_batch_limit")}
