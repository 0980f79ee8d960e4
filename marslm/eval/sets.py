"""Evaluation sets: chat examples with a family each, and the scorer that judges the responses.

``load_eval_set`` names them all: the embedded toy suite and its reworded variant, and files in
the GSM8K, HumanEval and recorded-answers formats (data/), told apart by their first record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

EVAL_SOURCES = (
    "toy, reworded, gsm8k:PATH, humaneval:PATH, answers:PATH, or a GSM8K/HumanEval/recorded-answers JSONL path"
)


@dataclass
class EvalSet:
    name: str
    examples: list  # objects with .messages and .family
    score_many: Callable[[list, list[str]], list[bool]]


def load_eval_set(source: str, n: int = 500, seed: int = 0) -> EvalSet:
    """``toy`` (the embedded suite's test split), ``reworded`` (its arithmetic and lists worded as the
    training data never does), ``gsm8k:PATH``, ``humaneval:PATH``, ``answers:PATH``, or a path whose
    first record tells the format (GSM8K: question/answer; HumanEval: task_id/prompt/test/entry_point;
    recorded answers, such as ``marslm distill``'s output: messages ending in the answer).

    Files give their first ``n`` records in file order; ``seed`` applies to ``toy`` and ``reworded``.
    """
    from ..data.sandbox import require_isolation

    if source == "toy":
        from ..data import toy

        require_isolation()  # its code family runs model-written code: refuse now, not after decoding
        return EvalSet("toy", toy.make_split("test", n, seed=seed), toy.score_many)
    if source == "reworded":  # off-distribution: toy arithmetic and lists, worded as training never does
        from ..data import reworded, toy

        return EvalSet("reworded", reworded.make_split(n, seed=seed), toy.score_many)
    kind, _, path = source.partition(":")
    if kind not in ("gsm8k", "humaneval", "answers") or not path:
        kind, path = _detect_eval_format(source), source
    if kind == "answers":
        from ..data import answers

        return EvalSet(source, answers.load_answers(path, n), answers.score_many)
    if kind == "gsm8k":
        from ..data import gsm8k

        return EvalSet(source, gsm8k.load_gsm8k(path, n), gsm8k.score_many)
    from ..data import humaneval

    require_isolation()

    return EvalSet(source, humaneval.load_humaneval(path, n), humaneval.score_many)


def _detect_eval_format(path: str) -> str:
    from ..data import answers, gsm8k, humaneval
    from ..data.jsonl import first_record

    if not Path(path).is_file():
        raise UserError(f"unknown evaluation data {path!r} (use {EVAL_SOURCES})")
    keys = set(first_record(path))
    if set(humaneval.KEYS) <= keys:
        return "humaneval"
    if set(gsm8k.KEYS) <= keys:
        return "gsm8k"
    if set(answers.KEYS) <= keys:
        return "answers"
    raise UserError(
        f"{path}: not a GSM8K (question, answer), HumanEval (task_id, prompt, test, entry_point) or "
        f"recorded-answers (messages) file; its first record has keys {sorted(keys)}"
    )
