"""``marslm distill``: a model's own greedy answers to a prompt set, as chat JSONL to train on.

Drafter training (EAGLE-3, DFlash) learns from the target model's regenerated answers, because
that is the text it will be asked to predict; MARS on a pretrained instruct model does the same.
The prompts: the toy suite's, and a procedurally generated set of everyday instructions
(data/instructions.py), or a chat JSONL file's user turns.

Decoding is ``marslm.generate`` at tau = 1, which is greedy AR decoding, with rows refilled as
others finish. Each answer is appended to the output as soon as it is done, one line
``{"id", "source", "messages": [..., {"role": "assistant", ...}], "answer_ids", "finished"}``,
so an interrupted run resumes by skipping the ids already written. ``marslm train`` reads the
file as it reads any chat JSONL (extra keys are ignored).

An answer that reaches ``max_new_tokens`` before its end-of-turn token is written to a second
file, ``OUTPUT.unfinished.jsonl``: trained as a chat turn it would end in the template's
end-of-turn token, teaching the model to stop where it was only cut.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from .data.distilled import done_ids, end_with_a_whole_line, unfinished_path
from .errors import UserError
from .files import output_file

SOURCES = ("instructions", "toy")
DEFAULT_PROMPTS = "instructions:600,toy:200"
# Rows decoded together: a wider batch spreads each read of the weights over more rows.
DEFAULT_BATCH = 64


@dataclass(frozen=True)
class Prompt:
    id: str
    source: str
    messages: list[dict]  # the conversation up to the answer


def parse_prompt_spec(spec: str) -> list[tuple[str, int | None]]:
    """``"instructions:600,toy:200"`` or a JSONL path -> ``[(source, n), ...]`` (n None: all of a file)."""
    parts = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, count = part.rpartition(":") if part.split(":")[0] in SOURCES else (part, "", "")
        if name in SOURCES:
            try:
                n = int(count)
            except ValueError:
                raise UserError(f"--prompts: expected SOURCE:N with N a number, got {part!r}") from None
            if n < 1:
                raise UserError(f"--prompts: N must be >= 1, got {part!r}")
            parts.append((name, n))
        elif Path(part).is_file():
            parts.append((part, None))
        else:
            raise UserError(f"--prompts: {part!r} is neither {' / '.join(s + ':N' for s in SOURCES)} nor a file")
    if not parts:
        raise UserError("--prompts is empty")
    return parts


def load_prompts(spec: str, split: str = "train", seed: int = 0) -> list[Prompt]:
    """The prompts a spec names, in order, each with a stable id; duplicates (same id) kept once."""
    prompts: list[Prompt] = []
    for source, n in parse_prompt_spec(spec):
        if source == "instructions":
            from .data import instructions

            try:
                items = instructions.make_split(split, n, seed=seed)
            except ValueError as exc:
                raise UserError(f"--prompts: {exc}") from None
            prompts += [Prompt(x.id, source, x.messages) for x in items]
        elif source == "toy":
            from .data import toy

            prompts += [Prompt(ex.id, source, ex.messages) for ex in toy.make_split(split, n, seed=seed)]
        else:
            from .data.jsonl import read_jsonl_records, record_to_messages

            for i, (where, record) in enumerate(read_jsonl_records(source)):
                messages = record_to_messages(record, where)
                first_answer = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
                if first_answer == 0:
                    raise UserError(f"{where}: the conversation opens with an answer: no turn before it to prompt with")
                prompts.append(Prompt(f"{Path(source).stem}-{i}", source, messages[:first_answer]))
    unique = {}
    for p in prompts:
        unique.setdefault(p.id, p)
    return list(unique.values())


def check_output(output: str | Path) -> Path:
    """``output`` as a file distill can append to (and its unfinished twin), refused in one line before any work."""
    for path in (Path(output), unfinished_path(output)):
        output_file(path, "--output")
    return Path(output)


def distill(
    model,
    tokenizer,
    prompts: list[Prompt],
    output: str | Path,
    *,
    max_new_tokens: int = 128,
    batch_size: int = DEFAULT_BATCH,
    progress: bool = True,
) -> dict:
    """Greedy answers to every prompt not yet in ``output``; returns counts ``{"done", "new", "unfinished"}``."""
    from tqdm.auto import tqdm

    from .decode import generate

    output, todo, counts = _pending(prompts, output, max_new_tokens, batch_size)
    if not todo:
        return counts

    bar = tqdm(total=len(prompts), initial=counts["done"], desc="distill", unit="answer", disable=not progress)
    with _appending() as append:

        def write(row):
            record = _answer_record(todo[row.request_id], row, tokenizer)
            append(output if row.stopped else unfinished_path(output), record)
            counts["new"] += 1
            counts["unfinished"] += not row.stopped
            bar.update(1)

        # tau = 1 reads no mask, so the model needs no mask token: any id stands in for it.
        generate(
            model,
            tokenizer,
            [p.messages for p in todo],
            tau=1.0,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            mask_token_id=tokenizer.eos_token_id,
            on_finish=write,
        )
    # A finished run leaves its output even when every answer was cut and went to the other file.
    output.parent.mkdir(parents=True, exist_ok=True)
    output.touch(exist_ok=True)
    bar.close()
    return counts


def _pending(prompts: list[Prompt], output: str | Path, max_new_tokens: int, batch_size: int):
    """``(output, the prompts it lacks, the counts so far)``, the arguments checked and the last
    line a killed run left in either file repaired first."""
    if max_new_tokens < 1 or batch_size < 1:
        raise UserError("--max-new-tokens and --batch-size must be >= 1")
    output = check_output(output)
    for path in (output, unfinished_path(output)):
        if path.is_file():
            end_with_a_whole_line(path)
    already = done_ids(output)
    todo = [p for p in prompts if p.id not in already]
    return output, todo, {"done": len(prompts) - len(todo), "new": 0, "unfinished": 0}


@contextmanager
def _appending() -> Iterator[Callable[[Path, dict], None]]:
    """``append(path, record)``: one JSON line, flushed at once. Each file is opened at its first
    record, so a run that fails before one (a prompt the tokenizer refuses) creates no file."""
    with ExitStack() as stack:
        files = {}

        def append(path: Path, record: dict) -> None:
            if path not in files:
                path.parent.mkdir(parents=True, exist_ok=True)
                files[path] = stack.enter_context(path.open("a", encoding="utf-8"))
            files[path].write(json.dumps(record) + "\n")
            files[path].flush()

        yield append


def _answer_record(prompt: Prompt, row, tokenizer) -> dict:
    """The output line of a prompt's finished row."""
    text = tokenizer.decode(row.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return {
        "id": prompt.id,
        "source": prompt.source,
        "messages": prompt.messages + [{"role": "assistant", "content": text}],
        "answer_ids": row.token_ids,
        "finished": row.stopped,
    }
