"""The toy suite for lm-evaluation-harness: the JSONL the task reads, and its scorer.

``toy_suite.yaml`` names :func:`process_results` with ``!function``; lm-eval imports this file
by path for that. ``python -m marslm.lm_eval_tasks.toy_suite`` writes the data file.

Each JSONL record carries what the scorer needs to rebuild the example: the prompt, the family,
the reference answer and the scorer's facts (``meta`` as a JSON string, because its shape
differs between families and a JSON dataset loader wants one schema per column).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from marslm.data import toy

DATA_FILE = "marslm_toy_suite.jsonl"


def to_record(example: toy.Example) -> dict:
    return {"id": example.id, "family": example.family, "prompt": example.messages[0]["content"],
            "answer": example.answer, "meta": json.dumps(example.meta)}


def from_record(doc: dict) -> toy.Example:
    return toy.Example(id=doc["id"], family=doc["family"], messages=[{"role": "user", "content": doc["prompt"]}],
                       answer=doc["answer"], meta=json.loads(doc["meta"]))


def write_data(out_dir: str | Path = ".", n: int = 200, split: str = "test", seed: int = 0,
               examples: list | None = None) -> Path:
    """Write the suite (or the given examples) as the task's JSONL; returns its path."""
    examples = examples if examples is not None else toy.make_split(split, n, seed=seed)
    path = Path(out_dir) / DATA_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(to_record(ex)) + "\n" for ex in examples), encoding="utf-8")
    return path


def process_results(doc: dict, results: list[str]) -> dict:
    """lm-eval's per-document hook: 1.0 if the response does what the instruction asked."""
    return {"acc": float(toy.score(from_record(doc), results[0]))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"write {DATA_FILE} for the marslm_toy lm-eval task")
    parser.add_argument("--out", default=".", help="directory to write into (run lm-eval from there)")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--split", choices=toy.SPLITS, default="test")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_data(args.out, args.n, args.split, args.seed))


if __name__ == "__main__":
    main()
