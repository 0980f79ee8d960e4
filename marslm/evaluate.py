"""Evaluation: accuracy per task family and tokens per forward, for each decoding setting.

An eval set is a list of examples (each with chat ``messages`` and a ``family``) and a scorer
that takes them with the model's responses. Decoding is batched with continuous refill, so a
long answer does not hold up a whole batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from .decode import generate
from .errors import UserError


@dataclass
class EvalSet:
    name: str
    examples: list                                     # objects with .messages and .family
    score_many: Callable[[list, list[str]], list[bool]]


def load_eval_set(source: str, n: int = 500, seed: int = 0) -> EvalSet:
    if source == "toy":
        from .data import toy

        return EvalSet("toy", toy.make_split("test", n, seed=seed), toy.score_many)
    raise UserError(f"unknown evaluation data {source!r} (available: toy)")


def evaluate(model, tokenizer, eval_set: EvalSet, *, taus=(1.0,), metric: str = "prob",
             block_size: int | None = None, cache: str = "cursor", mode: str = "threshold",
             batch_size: int = 32, max_new_tokens: int = 192, use_last_mask: bool = False,
             progress: bool = True, model_name: str | None = None) -> dict:
    """``{"model", "data", "results": [one entry per tau]}``; see :func:`_summarise` for an entry."""
    from tqdm.auto import tqdm

    prompts = [ex.messages for ex in eval_set.examples]
    results = []
    for tau in taus:
        bar = tqdm(total=len(prompts), desc=f"eval tau={tau}", unit="ans", disable=not progress, leave=False)
        started = time.perf_counter()
        out = generate(model, tokenizer, prompts, tau=tau, metric=metric, block_size=block_size, cache=cache,
                       mode=mode, batch_size=batch_size, max_new_tokens=max_new_tokens,
                       use_last_mask=use_last_mask, on_finish=lambda _row: bar.update(1))
        seconds = time.perf_counter() - started
        bar.close()
        correct = eval_set.score_many(eval_set.examples, out.texts)
        entry = _summarise(eval_set.examples, correct, out.accepted_per_step, seconds)
        entry.update(tau=tau, metric=metric, block_size=block_size, cache=cache, mode=mode,
                     use_last_mask=use_last_mask)
        results.append(entry)
    return {"model": model_name or getattr(model, "name_or_path", ""), "data": eval_set.name, "results": results}


def _summarise(examples, correct, accepted_per_step, seconds) -> dict:
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
        "families": {name: {"accuracy": f["correct"] / f["n"], "n": f["n"],
                            "tokens_per_forward": f["tokens"] / f["forwards"]}
                     for name, f in sorted(by_family.items())},
    }


def format_table(reports: dict[str, dict]) -> str:
    """A markdown table: one row per (model, setting), accuracy per family, tokens per forward."""
    families = sorted({f for rep in reports.values() for r in rep["results"] for f in r["families"]})
    head = ["model", "tau", "accuracy", *families, "tok/fwd", "fwd/answer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rep in reports.items():
        for r in rep["results"]:
            cells = [label, f"{r['tau']:g}", f"{100 * r['accuracy']:.1f}"]
            cells += [f"{100 * r['families'][f]['accuracy']:.1f}" if f in r["families"] else "-" for f in families]
            cells += [f"{r['tokens_per_forward']:.2f}", f"{r['forwards_per_answer']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
