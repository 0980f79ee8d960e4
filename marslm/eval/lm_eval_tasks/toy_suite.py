"""The toy suite for lm-evaluation-harness: its data, generated on demand, and its scorer.

``toy_suite.yaml`` names :func:`load_dataset` and :func:`process_results` with ``!function``;
lm-eval imports this file by path for that.

Each record carries what the scorer needs to rebuild the example: the prompt, the family, the
reference answer and the scorer's facts (``meta`` as a JSON string, because its shape differs
between families and a dataset wants one schema per column).
"""

from __future__ import annotations

import json

from marslm.data import toy


def to_record(example: toy.Example) -> dict:
    return {
        "id": example.id,
        "family": example.family,
        "prompt": example.messages[0]["content"],
        "answer": example.answer,
        "meta": json.dumps(example.meta),
    }


def from_record(doc: dict) -> toy.Example:
    return toy.Example(
        id=doc["id"],
        family=doc["family"],
        messages=[{"role": "user", "content": doc["prompt"]}],
        answer=doc["answer"],
        meta=json.loads(doc["meta"]),
    )


def load_dataset(split: str = "test", n: int = 200, seed: int = 0, **_metadata):
    """The task's data, generated on demand (lm-eval's ``custom_dataset``); ``--metadata
    '{"n": 500, "split": "test", "seed": 0}'`` chooses the items."""
    import datasets

    examples = toy.make_split(split, int(n), seed=int(seed))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([to_record(ex) for ex in examples])})


def process_results(doc: dict, results: list[str]) -> dict:
    """lm-eval's per-document hook: 1.0 if the response does what the instruction asked."""
    return {"acc": float(toy.score(from_record(doc), results[0]))}
