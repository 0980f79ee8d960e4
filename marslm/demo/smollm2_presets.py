"""The SmolLM2 demo's presets (``marslm demo --preset smollm2``): the data, the training settings
over ``marslm train``'s and the measurements' sizes. Torch-free: the CLI reads the preset names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import UserError

# marslm train's settings every preset starts from (TrainConfig field names); a preset's own
# ``train`` entries replace them. On a CPU, bf16 is autocast (fast with AMX / AVX-512 BF16).
TRAIN_DEFAULTS = dict(
    block_size=4,
    batch_size=8,
    grad_accum=1,
    max_length=256,
    precision="bf16",
    packing=True,
    warmup_ratio=0.05,
    save_steps=25,
)


@dataclass(frozen=True)
class RealModelPreset:
    train_prompts: str  # distill prompt spec (distill.parse_prompt_spec)
    heldout_instructions: int  # held-out generated instructions (agreement, learning curve)
    heldout_toy: int  # held-out toy-suite items (agreement and toy accuracy)
    max_new_tokens: int  # longest distilled / evaluated answer
    train: dict  # marslm train's settings over TRAIN_DEFAULTS (max_steps and the recipe)
    taus: tuple = (1.0, 0.95, 0.9, 0.8)
    curve_points: int = 6
    curve_prompts: int = 16
    curve_tokens: int = 64
    distill_batch: int = 64
    eval_batch: int = 16
    bench_prompts: int = 8  # decoding speed: prompts and new tokens per contender
    bench_tokens: int = 64
    seed: int = 0


def training_config(preset: RealModelPreset, original: Path, data: Path, output: Path, progress: bool):
    """The preset's MARS stage as ``marslm train`` runs it."""
    from ..training.config import TrainConfig

    settings = {**TRAIN_DEFAULTS, **preset.train}
    settings.setdefault("logging_steps", max(1, min(10, settings["max_steps"] // 10)))
    return TrainConfig(
        stage="mars",
        model=str(original),
        data=str(data),
        output=str(output),
        seed=preset.seed,
        progress=progress,
        extra={"demo_preset": asdict(preset)},
        **settings,
    )


SMOLLM2_PRESETS = {
    # The CPU recipe: exact mode (the original's outputs stay its own by construction), a gated
    # LoRA of rank 64 on the attention's Linears, 600 steps at a rate held after the warmup, on the
    # greedy answers to 3,000 prompts. About 70 minutes on 2 cores, distillation included; the
    # recipes it replaced are in docs/log/.
    "smollm2": RealModelPreset(
        train_prompts="instructions:2400,toy:600",
        heldout_instructions=48,
        heldout_toy=32,
        max_new_tokens=128,
        train=dict(
            max_steps=600,
            exact=True,
            learning_rate=1e-3,
            lr_schedule="constant_with_warmup",
            lora_rank=64,
            lora_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            random_phase=True,
        ),
        curve_points=12,
    ),
    # The test suite's end-to-end run: a few prompts, two steps; it checks the plumbing, not quality.
    "smollm2-quick": RealModelPreset(
        train_prompts="instructions:6,toy:2",
        heldout_instructions=3,
        heldout_toy=2,
        max_new_tokens=32,
        train=dict(max_steps=2, exact=True, lora_rank=4, batch_size=4, learning_rate=1e-3, max_length=96, save_steps=1),
        taus=(1.0, 0.9),
        curve_points=2,
        curve_prompts=2,
        curve_tokens=12,
        distill_batch=4,
        eval_batch=4,
        bench_prompts=2,
        bench_tokens=8,
    ),
}


def resolve_preset(preset: str | RealModelPreset, **overrides) -> RealModelPreset:
    """The named preset (or ``preset`` itself) with ``overrides`` applied."""
    if isinstance(preset, str):
        if preset not in SMOLLM2_PRESETS:
            raise UserError(f"unknown preset {preset!r}; choose from {', '.join(SMOLLM2_PRESETS)}")
        preset = SMOLLM2_PRESETS[preset]
    return replace(preset, **overrides)


def heldout_spec(preset: RealModelPreset) -> str:
    return f"instructions:{preset.heldout_instructions},toy:{preset.heldout_toy}"


def describe(cfg) -> str:
    """What a MARS stage trains, in a few words."""
    if cfg.exact:
        rows = "a mask row per offset" if cfg.mask_rows == "per-offset" else "one mask row"
        return f"exact mode ({rows}, gated LoRA rank {cfg.lora_rank or 0})"
    if cfg.mask_only:
        return "the mask row only"
    return f"top {cfg.train_layers} layers" if cfg.train_layers else "all layers"
