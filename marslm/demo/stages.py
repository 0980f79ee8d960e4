"""What the demos' multi-stage runs share: the stage printer and its clock, a JSON store that
keeps each finished result across interrupted runs, and a training callback at chosen steps.

Torch-free at import: the CLI builds the demo's parser from modules that import this one.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from ..files import read_json, write_json_atomically


def say(name: str, message: str) -> None:
    print(f"[{name}] {message}", flush=True)


class Stages:
    """Prints ``[name] i/n what`` lines and records how long each named block takes."""

    def __init__(self, name: str, total: int):
        self.name, self.total = name, total
        self.seconds: dict[str, float] = {}
        self.started = time.time()

    def say(self, message: str) -> None:
        say(self.name, message)

    def stage(self, number: int, message: str) -> None:
        self.say(f"{number}/{self.total} {message}")

    @contextmanager
    def timed(self, key: str):
        started = time.time()
        try:
            yield
        finally:
            self.seconds[key] = time.time() - started

    def timings(self) -> dict[str, float]:
        """Each block's seconds and the total so far, rounded for a report."""
        return {**{k: round(v, 1) for k, v in self.seconds.items()}, "total": round(time.time() - self.started, 1)}


class JsonStore:
    """A JSON value in a file, rewritten whole after every change: an interrupted run keeps each
    finished entry, and a rerun skips it."""

    def __init__(self, path: str | Path, empty):
        self.path = Path(path)
        self.value = read_json(self.path) if self.path.is_file() else empty

    def save(self) -> None:
        write_json_atomically(self.path, self.value)


class StepPoints(JsonStore):
    """Measurements by training step (a learning curve), kept sorted, one per step."""

    def __init__(self, path: str | Path):
        super().__init__(path, [])

    def has(self, step: int) -> bool:
        return any(p["step"] == step for p in self.value)

    def add(self, point: dict) -> None:
        others = [p for p in self.value if p["step"] != point["step"]]
        self.value = sorted(others + [point], key=lambda p: p["step"])
        self.save()


def curve_steps(total_steps: int, points: int) -> list[int]:
    """Evenly spaced evaluation steps ending at the last one, also when ``points`` does not divide it."""
    return sorted({max(1, round(k * total_steps / points)) for k in range(1, points + 1)})


def at_steps(steps, measure, at_start: bool = False):
    """A Trainer callback that calls ``measure(model, tokenizer, step)`` after each step in
    ``steps`` (and before the first, with ``at_start``), on the model as saved: the forward the
    trainer wraps in bf16 autocast is unwrapped for the call, because a float32 checkpoint is
    what gets evaluated, and bf16 logits flip near-ties of the greedy choice."""
    from transformers import TrainerCallback

    steps = set(steps)

    def call(model, tokenizer, step):
        wrapped = model.__dict__.pop("forward", None) if hasattr(model, "_original_forward") else None
        was_training = model.training
        model.eval()
        try:
            measure(model, tokenizer, step)
        finally:
            model.train(was_training)
            if wrapped is not None:
                model.forward = wrapped

    class AtSteps(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
            if at_start and state.global_step == 0:
                call(model, processing_class, 0)

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if state.global_step in steps:
                call(model, processing_class, state.global_step)

    return AtSteps()
