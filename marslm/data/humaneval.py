"""HumanEval-format problems: ``{"task_id", "prompt", "test", "entry_point"}`` per JSONL line.

A chat model is asked to complete the function and usually answers with a code block holding
the whole function. The execution contract is HumanEval's own: the program

    problem["prompt"] + completion + "\\n" + problem["test"] + "\\n" + f"check({entry_point})"

must run to the end within a timeout. When the response restates ``def <entry_point>``, the
completion is that code on a fresh line, so it redefines the function after the prompt's stub
(the prompt's imports stay in scope); otherwise the response is taken as the body that
continues the prompt, as a base model would write it.

Programs run in marslm's sandbox (``marslm.data.sandbox``: bubblewrap, no network, a read-only file
system, resource limits, a timeout), never in our process.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .jsonl import read_jsonl_records, require_strings
from .sandbox import run_many_to_end
from .toy import extract_code

FAMILY = "humaneval"
KEYS = ("task_id", "prompt", "test", "entry_point")
CHECK_TIMEOUT_S = 5.0
INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a ```python "
    "code block.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class HumanEvalExample:
    id: str  # the task_id
    family: str
    messages: list[dict]  # the instruction and the function stub, as one user message
    problem: dict  # task_id, prompt, test, entry_point: what the harness runs


def load_humaneval(path: str | Path, n: int | None = None) -> list[HumanEvalExample]:
    """The first ``n`` problems of a HumanEval-format JSONL file (all of them when n is None)."""
    examples = []
    for where, record in read_jsonl_records(path):
        require_strings(record, KEYS, where, "HumanEval")
        problem = {key: record[key] for key in KEYS}
        examples.append(
            HumanEvalExample(
                id=problem["task_id"],
                family=FAMILY,
                problem=problem,
                messages=[{"role": "user", "content": INSTRUCTION.format(**problem)}],
            )
        )
        if n is not None and len(examples) >= n:
            break
    return examples


def completion_from_response(problem: dict, response: str) -> str:
    """What to append to the prompt (see the module docstring)."""
    code = extract_code(response)
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return "\n" + code
    return code


def score_many(
    examples: Sequence[HumanEvalExample], responses: Sequence[str], timeout: float = CHECK_TIMEOUT_S
) -> list[bool]:
    problems = [ex.problem for ex in examples]
    completions = [
        completion_from_response(ex.problem, r) if isinstance(r, str) else ""
        for ex, r in zip(examples, responses, strict=True)
    ]
    return run_checks(problems, completions, timeout)


def run_checks(problems: Sequence[dict], completions: Sequence[str], timeout: float = CHECK_TIMEOUT_S) -> list[bool]:
    """Pass/fail of each ``prompt + completion + test + check(entry_point)`` program: it passes
    when it runs to its end (``sandbox.run_to_end``: an exit of its own is no pass)."""
    programs = [
        p["prompt"] + c + "\n" + p["test"] + "\n" + f"check({p['entry_point']})\n"
        for p, c in zip(problems, completions, strict=True)
    ]
    return [output is not None for output in run_many_to_end(programs, timeout)]
