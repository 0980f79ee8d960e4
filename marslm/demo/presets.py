"""The toy demo's presets (``marslm demo``, ``marslm ablate``): the suite, the model, and each
training stage as ``marslm train`` settings. Torch-free: the CLI reads the preset names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UserError

# marslm train's settings every stage of a toy demo starts from (TrainConfig field names); a
# preset's own ``train`` entries replace them.
TRAIN_DEFAULTS = dict(
    data="toy",
    batch_size=32,
    packing=True,  # pack sequences into rows: the padded batch's loss and gradients, fewer FLOPs
    max_length=192,
    logging_steps=25,
    save_steps=10**9,  # no checkpoints inside a stage: an interrupted stage starts over
    warmup_ratio=0.03,
    weight_decay=0.0,
)


@dataclass(frozen=True)
class DemoPreset:
    """A toy demo: its suite and model, and each training stage as ``marslm train`` settings
    (TrainConfig field names) over the ones every stage shares."""

    model: str  # toy_model preset
    vocab_size: int
    train_examples: int  # the suite's training items: the tokenizer's texts and every stage's data
    test_examples: int
    ar: dict  # the AR stage's steps, learning rate and family mixture
    after_ar: dict  # the steps and schedule of the two stages that continue the AR checkpoint: MARS and its control
    mars: dict  # MARS's own settings (block size, SFT-loss weight): all its control lacks
    train: dict = field(default_factory=dict)  # every stage's, over TRAIN_DEFAULTS
    taus: tuple = (1.0, 0.95, 0.9)
    curve_points: int = 6  # AR learning-curve evaluations
    curve_items: int = 100
    seed: int = 0  # the suite's, the model's initialisation and every stage's


# Only the AR stage has a family mixture (data_mix): it is there to bring the slowest family up to
# the others, while MARS learns what to predict ahead from the suite as evaluated (balanced).
DEMO_PRESETS = {
    # Smoke runs and the test suite: minutes, no quality claims (a mixture, to run that path too).
    "quick": DemoPreset(
        model="test",
        vocab_size=512,
        train_examples=2000,
        test_examples=48,
        train=dict(batch_size=16),
        ar=dict(max_steps=60, learning_rate=3e-3, data_mix={"lists": 2.0}),
        after_ar=dict(max_steps=30, learning_rate=1e-3),
        mars=dict(block_size=4, ar_weight=1.0),
        curve_points=2,
        curve_items=16,
    ),
    # The numbers we quote. Most of the budget goes to the AR stage, to give MARS the strongest
    # baseline it allows; MARS weights the clean-stream (SFT) loss 2x, which on a model this small
    # keeps one-token accuracy at no cost in tokens per forward (docs/results.md).
    "default": DemoPreset(
        model="quick",
        vocab_size=1024,
        train_examples=20000,
        test_examples=500,
        ar=dict(max_steps=3000, learning_rate=3e-3),
        after_ar=dict(max_steps=500, learning_rate=1e-3),
        mars=dict(block_size=4, ar_weight=2.0),
    ),
    # AR stopped half way up its learning curve, MARS twice as long: the ablation's setting.
    "short": DemoPreset(
        model="quick",
        vocab_size=1024,
        train_examples=20000,
        test_examples=500,
        ar=dict(max_steps=1600, learning_rate=3e-3),
        after_ar=dict(max_steps=800, learning_rate=1e-3),
        mars=dict(block_size=4, ar_weight=1.0),
    ),
}


def resolve_preset(preset: str | DemoPreset, **overrides) -> DemoPreset:
    if isinstance(preset, str):
        if preset not in DEMO_PRESETS:
            raise UserError(f"unknown preset {preset!r}; choose from {', '.join(DEMO_PRESETS)}")
        preset = DEMO_PRESETS[preset]
    return replace(preset, **overrides)


def stage_config(preset: DemoPreset, model: Path, output: Path, progress: bool, settings: dict):
    """A stage as ``marslm train`` runs it: the settings every stage shares with the stage's own
    ``settings`` over them (shared with the ablation, so its rows compare)."""
    from ..training.config import TrainConfig

    shared = TrainConfig(
        stage="ar",
        model=str(model),
        output=str(output),
        data_n=preset.train_examples,
        data_seed=preset.seed,
        seed=preset.seed,
        progress=progress,
        **{**TRAIN_DEFAULTS, **preset.train},
    )
    return replace(shared, **settings)


def stage_configs(preset: DemoPreset, out: Path, progress: bool) -> dict:
    """The three stages a demo trains, by their directory in OUT: AR SFT from the base model, then
    MARS and its compute-matched control, both from the AR checkpoint."""
    mars = {"stage": "mars", **preset.after_ar, **preset.mars}
    return {
        "ar": stage_config(preset, out / "base", out / "ar", progress, preset.ar),
        "mars": stage_config(preset, out / "ar", out / "mars", progress, mars),
        "ar_control": stage_config(preset, out / "ar", out / "ar_control", progress, preset.after_ar),
    }
