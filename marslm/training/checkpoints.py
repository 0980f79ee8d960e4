"""Crash-safe training checkpoints: a checkpoint counts only once every file of it is written.

Trainer writes ``checkpoint-N/`` file by file, so a kill part way leaves a directory that looks
like a checkpoint (and resuming from it fails for good). Once Trainer has written everything, a
marker listing every file, its size and its sha256 is renamed into place, last: a checkpoint is
complete iff the marker is there and every file it lists has that size (and, checked before a run
resumes from it, those bytes). Light on purpose (no torch at import):
``marslm train`` decides whether it resumes before anything heavy loads.

Beside them: the run record that ties ``OUT.partial/`` to the settings that wrote it (a rerun
with other settings is refused, not resumed), the resume point every process agrees on, and the
final save, written next to ``OUT`` and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from ..errors import UserError
from ..files import read_json, write_json_atomically
from ..mars_json import MarsConfig
from ..settings import flag_of
from .config import TrainConfig

log = logging.getLogger("marslm.train")

CHECKPOINT_MARKER = "marslm-complete.json"


def mark_checkpoint_complete(directory: Path) -> None:
    files = {
        str(p.relative_to(directory)): [p.stat().st_size, _sha256(p)]
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != CHECKPOINT_MARKER
    }
    tmp = directory / (CHECKPOINT_MARKER + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, directory / CHECKPOINT_MARKER)


def checkpoint_is_complete(directory: Path, contents: bool = False) -> bool:
    """Every file the marker lists is there at its size; with ``contents``, also with its bytes
    (a file damaged in place keeps its size): the check made before resuming from it."""
    try:
        files = json.loads((directory / CHECKPOINT_MARKER).read_text())["files"]
        return bool(files) and all(
            (directory / name).stat().st_size == size and (not contents or _sha256(directory / name) == sha)
            for name, (size, sha) in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


class NonFiniteTraining(UserError):
    """Training diverged (NaN or inf); the run stops before saving from it."""


def require_finite_parameters(model, step: int) -> None:
    """Refuse to save weights that are not finite: every checkpoint and the final model."""
    for name, param in model.named_parameters():
        if param.numel() and not param.isfinite().all():
            raise NonFiniteTraining(f"parameter {name} is not finite after step {step}")


def _checkpoint_step(path: Path) -> int:
    suffix = path.name.removeprefix("checkpoint-")
    return int(suffix) if suffix.isdigit() else -1


def resume_point(partial_dir: Path, resume: bool) -> Path | None:
    """The newest complete checkpoint to resume from (None: start afresh). What a kill left
    half-written is deleted: incomplete checkpoints and an unfinished final directory. Without
    ``resume`` everything from an earlier run goes."""
    if not partial_dir.is_dir():
        return None
    if not resume:
        shutil.rmtree(partial_dir)
        return None
    shutil.rmtree(partial_dir / "final", ignore_errors=True)
    newest = None
    for path in sorted(partial_dir.glob("checkpoint-*"), key=_checkpoint_step, reverse=True):
        if newest is None and checkpoint_is_complete(path, contents=True):
            newest = path
        elif not checkpoint_is_complete(path):
            log.warning("removing %s: an interrupted run left it incomplete", path)
            shutil.rmtree(path)
        elif newest is None:
            log.warning("removing %s: a file in it changed since it was written", path)
            shutil.rmtree(path)
    return newest


RUN_SETTINGS = "marslm-run.json"
# The run record's key for the encoding key (dataset.encoding_key): the data as bytes, not as a path.
DATA_KEY = "data_key"

# Fields that change nothing a run computes: a rerun may change them and still resume.
_NOT_THE_RUN = ("output", "overwrite", "resume", "progress", "save_steps", "logging_steps", "extra")


def partial_dir_of(output: str) -> Path:
    return Path(str(Path(output)) + ".partial")


def _main_process() -> bool:
    """Rank 0 of a distributed run (torchrun and accelerate set RANK), or a run of one process."""
    return os.environ.get("RANK", "0") == "0"


@contextmanager
def one_run_per_output(output: str):
    """Hold OUT for this run: a second run into the same OUT, started while this one trains, is
    refused in one line instead of resuming this run's live checkpoints. The lock (an advisory
    ``flock``, released by the kernel when the process ends, ``kill -9`` included) lives in the
    cache directory, so OUT's neighbourhood gets no lock file."""
    import fcntl

    from .cache import cache_dir, digest

    if not _main_process():  # the ranks of one distributed run share OUT: the first holds it for all
        yield
        return
    path = cache_dir().parent / "locks" / f"{digest(str(Path(output).absolute()))}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another run is training into {output}; wait for it, or choose another --output") from None
        yield


@contextmanager
def nothing_left_on_failure(partial_dir: Path):
    """A run that fails before its first complete checkpoint removes the ``OUT.partial/`` it
    created: there is nothing in it to resume from. An existing one (a run being resumed) stays."""
    existed = partial_dir.exists()
    try:
        yield
    except BaseException:
        if _main_process() and not existed and partial_dir.is_dir():
            if not any(checkpoint_is_complete(p) for p in partial_dir.glob("checkpoint-*")):
                shutil.rmtree(partial_dir, ignore_errors=True)
        raise


def run_settings(cfg: TrainConfig) -> dict:
    """The settings that define a run, as JSON would give them back, defaults made definite."""
    settings = asdict(cfg.with_defaults())
    return json.loads(json.dumps({k: v for k, v in settings.items() if k not in _NOT_THE_RUN}))


def may_resume(cfg: TrainConfig) -> bool:
    """Whether the run resumes from what an interrupted run left in ``OUT.partial/`` (read-only,
    so it runs before anything loads). Checkpoints are only resumed by the run they belong to
    (its settings, recorded there by :func:`record_run`): a rerun with other data, learning rate
    or steps is refused, and --overwrite discards them as --no-resume does."""
    partial_dir = partial_dir_of(cfg.output)
    if not cfg.resume or not any(checkpoint_is_complete(p) for p in partial_dir.glob("checkpoint-*")):
        return cfg.resume
    way_out = "pass --no-resume or --overwrite to discard its checkpoints and start afresh"
    path = partial_dir / RUN_SETTINGS
    recorded = read_json(path, hint=f"; {way_out}") if path.is_file() else None
    if isinstance(recorded, dict):
        recorded.pop(DATA_KEY, None)  # checked once the data is encoded: resumes_same_data
    now = run_settings(cfg)
    if recorded == now:
        return True
    if cfg.overwrite:
        return False
    if not isinstance(recorded, dict):
        raise UserError(f"{partial_dir} holds checkpoints of a run whose settings were not recorded; {way_out}")
    name = next(k for k in sorted(set(recorded) | set(now)) if recorded.get(k) != now.get(k))
    raise UserError(
        f"{partial_dir} holds checkpoints of a run with {flag_of(TrainConfig, name)} {recorded.get(name)!r}, "
        f"not {now.get(name)!r}: rerun with its settings to resume it, or {way_out}"
    )


def resumes_same_data(cfg: TrainConfig, data_key: str, resume: bool) -> bool:
    """:func:`may_resume`'s answer, once the data is encoded: checkpoints trained on other data under
    the same path (the file rewritten, the tokenizer changed) are refused, or discarded with --overwrite."""
    path = partial_dir_of(cfg.output) / RUN_SETTINGS
    if not resume or not any(checkpoint_is_complete(p) for p in path.parent.glob("checkpoint-*")):
        return resume
    recorded = read_json(path) if path.is_file() else None
    if isinstance(recorded, dict) and recorded.get(DATA_KEY) == data_key:
        return True
    if cfg.overwrite:
        return False
    raise UserError(
        f"{path.parent} holds checkpoints of a run on other data ({cfg.data} or the tokenizer changed since): "
        "pass --no-resume or --overwrite to discard them and start afresh"
    )


def record_run(partial_dir: Path, cfg: TrainConfig, data_key: str) -> None:
    write_json_atomically(partial_dir / RUN_SETTINGS, {**run_settings(cfg), DATA_KEY: data_key})


def agreed_resume_point(trainer, partial_dir: Path, cfg: TrainConfig, resume: bool, data_key: str) -> Path | None:
    """The checkpoint to continue from (None: from the start), agreed by every process."""
    resume_from = resume_point(partial_dir, resume) if trainer.is_world_process_zero() else None
    if trainer.is_world_process_zero():
        record_run(partial_dir, cfg, data_key)
    trainer.accelerator.wait_for_everyone()  # rank 0 has cleaned up before any rank looks
    if not trainer.is_world_process_zero():
        resume_from = resume_point(partial_dir, True)  # read-only now: nothing incomplete is left
    if resume_from is not None:
        log.warning("resuming from %s", resume_from)
    return resume_from


def train_from(trainer, checkpoint: Path | None) -> int:
    """``trainer.train()`` from ``checkpoint``; returns the global step reached.

    A checkpoint that already holds the last step (the run was killed while writing its final
    directory) is loaded, not trained from: Trainer checks ``max_steps`` only after a step, so it
    would take one step more than asked."""
    if checkpoint is not None and trainer.args.max_steps > 0:
        from transformers import TrainerState

        state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        if state.global_step >= trainer.args.max_steps:
            trainer._load_from_checkpoint(str(checkpoint))
            trainer.state = state
            return state.global_step
    return trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None).global_step


def last_loss(trainer) -> float | None:
    """The last logged loss, or the run's mean loss when it ended before the first log."""
    history = trainer.state.log_history
    losses = [e["loss"] for e in history if "loss" in e] or [e["train_loss"] for e in history if "train_loss" in e]
    return float(losses[-1]) if losses else None


def save_atomically(trainer, mars_config: MarsConfig, output: Path, partial_dir: Path, overwrite: bool) -> None:
    """Write the final model next to ``output`` and rename it into place (process 0 only)."""
    from ..adapter import adapter_of, save_checkpoint
    from .surgery import merge_lora

    staging = partial_dir / "final"
    require_finite_parameters(trainer.model, trainer.state.global_step)
    model = merge_lora(trainer.model)
    if adapter_of(model) is not None:  # exact mode: the original's files, the adapter beside them
        if trainer.is_world_process_zero():
            save_checkpoint(model, trainer.processing_class, str(mars_config.base_model), staging)
    elif model is trainer.model:
        trainer.save_model(str(staging))  # gathers sharded (FSDP/DeepSpeed) weights
    elif trainer.is_world_process_zero():  # LoRA: the merged weights, as a plain checkpoint
        model.save_pretrained(str(staging))
        trainer.processing_class.save_pretrained(str(staging))
    if not trainer.is_world_process_zero():
        return
    if adapter_of(model) is None:
        model.generation_config.save_pretrained(str(staging))
    mars_config.save(staging)
    (staging / "training_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    if output.exists():
        if not overwrite and any(output.iterdir()):
            raise UserError(f"output directory {output} appeared during training; the model is in {staging}")
        old = output.with_name(output.name + ".old")
        os.replace(output, old)
        os.replace(staging, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, output)
    shutil.rmtree(partial_dir, ignore_errors=True)
