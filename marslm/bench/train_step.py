"""``marslm bench --train-step``: what a MARS training step costs against an AR (SFT) step.

For a model (a checkpoint, or a named shape with random weights) and each sequence length, one
optimizer-free training step (forward and backward) of the MARS objective and of plain SFT are
timed on the same random batch, in turn within each repeat after a warm-up, and their peak memory
is recorded: on CUDA the allocator's peak, on a CPU the process's peak resident set (Linux
``VmHWM``, reset before each step), each above what was in use before the step. The answer share
of each row is ``1 - prompt_share``: the loss, and MARS's noisy stream, cover only the answer.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from ..errors import UserError
from ..mars_json import DEFAULT_BLOCK_SIZE
from ..modeling import count_parameters
from .config import SHAPES


def build_shape(name: str, layers: int | None = None, attention: str = "sdpa", dtype=torch.float32, device=None):
    """A randomly initialised model of a named shape (``SHAPES``), optionally with fewer layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in SHAPES:
        raise UserError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    spec = dict(SHAPES[name])
    if layers is not None:
        if not 1 <= layers <= spec["num_hidden_layers"]:
            raise UserError(f"--layers must be in 1..{spec['num_hidden_layers']} for {name}, got {layers}")
        spec["num_hidden_layers"] = layers
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = attention
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    return model


def random_batch(vocab: int, rows: int, length: int, prompt_share: float, mask_id: int, seed: int = 0) -> dict:
    """Random token rows whose first ``prompt_share`` of tokens carry no target."""
    from ..chat import IGNORE

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    ids[ids == mask_id] = (mask_id + 1) % vocab
    labels = ids.clone()
    labels[:, : int(round(prompt_share * length))] = IGNORE
    return {"input_ids": ids, "labels": labels}


class _Peak:
    """Peak memory of a block above what was in use when it began, in bytes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self.start = _reset_cpu_peak()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.start
        elif self.start is not None:
            self.bytes = _status_kib("VmHWM") * 1024 - self.start
        return False


def _return_freed_memory() -> None:
    """glibc keeps freed blocks under its mmap threshold in the heap and reuses them, so a step's
    peak would not show in the resident set; from here on blocks over 64 KiB are mapped, and
    unmapped when freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_cpu_peak() -> int | None:
    """Reset the peak resident set to the current one (Linux); returns the current one in bytes."""
    _return_freed_memory()
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    rss = _status_kib("VmRSS")
    return None if rss is None else rss * 1024


def _step(model, batch, stage: str, block_size: int, mask_id: int, target_logits: bool) -> None:
    from ..training.objective import LossOptions, ar_loss, mars_loss

    model.zero_grad(set_to_none=True)
    if stage == "mars":
        loss = mars_loss(
            model, batch["input_ids"], batch["labels"], LossOptions(block_size, mask_id, target_logits=target_logits)
        )["loss"]
    else:
        loss = ar_loss(model, batch["input_ids"], batch["labels"], target_logits=target_logits)["loss"]
    loss.backward()
    model.zero_grad(set_to_none=True)


def train_step_bench(
    model,
    *,
    seq_lens,
    batch_size: int = 1,
    prompt_share: float = 0.3,
    block_size: int = DEFAULT_BLOCK_SIZE,
    repeats: int = 3,
    target_logits=(True,),
    bf16: bool = False,
    progress: bool = True,
) -> dict:
    """Time and peak memory of a MARS step and an AR step, per sequence length (module docstring).

    ``target_logits``: the settings to compare (True: the fused target-only head, False: full
    logits at every column). Returns ``{"setup": ..., "rows": [...]}``, one row per length,
    setting and stage, with the median seconds and the largest peak over the repeats.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    mask_id = vocab - 1
    model.train()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    configs = [(setting, stage) for setting in target_logits for stage in ("ar", "mars")]
    bar = tqdm(total=len(seq_lens) * (repeats + 1) * len(configs), desc="train step", disable=not progress)
    rows = []
    for length in seq_lens:
        batch = random_batch(vocab, batch_size, length, prompt_share, mask_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        step = partial(_step, model, batch, block_size=block_size, mask_id=mask_id)
        rows += _measure_length(step, length, configs, repeats, autocast, device, bar)
    bar.close()
    _add_ratios(rows)
    return {
        "setup": {
            "device": str(device),
            "parameters": count_parameters(model),
            "layers": model.config.num_hidden_layers,
            "vocab": vocab,
            "batch_size": batch_size,
            "prompt_share": prompt_share,
            "block_size": block_size,
            "repeats": repeats,
            "bf16": bf16,
            "attention": getattr(model.config, "_attn_implementation", None),
            "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            "peak_memory": "allocator peak (CUDA)" if device.type == "cuda" else "peak resident set (VmHWM)",
        },
        "rows": rows,
    }


def _measure_length(step, length: int, configs, repeats: int, autocast, device, bar) -> list[dict]:
    """One row per (setting, stage) at one length: the median seconds and the largest peak over
    ``repeats`` rounds after a warm-up round; the settings take turns within each round."""
    times = {c: [] for c in configs}
    peaks = {c: [] for c in configs}
    errors = {}
    for repeat in range(repeats + 1):  # the first round warms up and is not kept
        for config in configs:
            bar.update(1)
            if config in errors:
                continue
            setting, stage = config
            try:
                with _Peak(device) as peak:
                    started = time.perf_counter()
                    with autocast:
                        step(stage=stage, target_logits=setting)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    seconds = time.perf_counter() - started
            except torch.OutOfMemoryError:
                errors[config] = "out of memory"
                torch.cuda.empty_cache()
                continue
            if repeat:
                times[config].append(seconds)
                if peak.bytes is not None:
                    peaks[config].append(peak.bytes)
    rows = []
    for config in configs:
        setting, stage = config
        row = {
            "seq_len": length,
            "logits": "targets" if setting else "full",
            "stage": stage,
            "seconds": statistics.median(times[config]) if times[config] else None,
            "peak_mib": round(max(peaks[config]) / 2**20, 1) if peaks[config] else None,
        }
        if config in errors:
            row["error"] = errors[config]
        rows.append(row)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    """Each MARS row gets its time and memory as ratios to the AR row of the same length and logits."""
    ar = {(r["seq_len"], r["logits"]): r for r in rows if r["stage"] == "ar"}
    for row in rows:
        base = ar[(row["seq_len"], row["logits"])]
        for key in ("seconds", "peak_mib"):
            if row["stage"] == "mars" and row.get(key) and base.get(key):
                row[f"{key}_vs_ar"] = round(row[key] / base[key], 2)


def format_train_step(report: dict) -> str:
    setup = report["setup"]
    lines = [
        f"{setup['parameters'] / 1e6:.1f}M parameters, {setup['layers']} layers, vocab {setup['vocab']:,}, "
        f"batch {setup['batch_size']}, prompt share {setup['prompt_share']:g}, B = {setup['block_size']}, "
        f"{setup['device']}, bf16 {setup['bf16']}, attention {setup['attention']}, "
        f"checkpointing {setup['gradient_checkpointing']}; peak memory: {setup['peak_memory']}",
        "",
        "| L | logits | step | seconds | vs AR | peak MiB | vs AR |",
        "|---|---|---|---|---|---|---|",
    ]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for r in report["rows"]:
        lines.append(
            f"| {r['seq_len']} | {r['logits']} | {r['stage'].upper()} | {fmt(r['seconds'], '.3f')} | "
            f"{fmt(r.get('seconds_vs_ar'), '.2f')} | {fmt(r['peak_mib'], '.1f')} | "
            f"{fmt(r.get('peak_mib_vs_ar'), '.2f')} |" + (f" {r['error']}" if "error" in r else "")
        )
    return "\n".join(lines)
