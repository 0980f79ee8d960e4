"""Toy drafters for the demo's checkpoints: the paper's Table 6 (AR->AR, AR->MARS, MARS->MARS) in small.

    python scripts/toy_drafters.py runs/demo [--out DIR] [--quick] [--quiet]

Reads the demo's preset (DEMO/marslm-demo.json) and tokenizer (DEMO/ar), builds a Qwen2 a quarter
of the demo model's width at its depth (the paper's 0.5B drafter is about a quarter of its 7B
target's width at nearly its depth) with that tokenizer, and trains it as the demo trains its
model: the library's ``train`` with the demo's stage arguments, on the same toy train split.

    the drafter, untrained            -> OUT/drafter-base
    AR SFT                            -> OUT/drafter-ar
    MARS from it                      -> OUT/drafter-mars

OUT is the demo folder unless --out says. ``--quick``: tiny data and steps, so a test runs it in
seconds (no quality). scripts/table6.sh then benches the drafters with the demo's checkpoints.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from marslm.errors import UserError
from marslm.experiments.demo import DEMO_MARKER, DemoPreset, train_arguments
from marslm.experiments.stages import Stages
from marslm.experiments.toy_model import MODEL_SIZES, TinyModelSpec

# --quick: enough to run every stage, nothing to learn from
QUICK = dict(train_examples=64, ar_steps=12, mars_steps=6, batch_size=8)
WIDTH_SHARE = 4  # the drafter's width: the target's over this


def demo_preset(demo: Path) -> DemoPreset:
    """The preset the demo in ``demo`` ran with (its marker records it)."""
    marker = demo / DEMO_MARKER
    if not marker.is_file() or not (demo / "ar").is_dir():
        raise UserError(f"{demo} holds no demo output ({DEMO_MARKER} and ar/); run `marslm demo --out {demo}` first")
    saved = json.loads(marker.read_text())["preset"]
    return DemoPreset(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def drafter_spec(spec: TinyModelSpec) -> TinyModelSpec:
    """``spec`` at a quarter of its width (hidden, MLP and heads), at its depth."""
    heads = max(1, spec.num_attention_heads // WIDTH_SHARE)
    kv_heads = max(1, spec.num_key_value_heads // WIDTH_SHARE)
    return replace(
        spec,
        hidden_size=spec.hidden_size // WIDTH_SHARE,
        intermediate_size=spec.intermediate_size // WIDTH_SHARE,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads if heads % kv_heads == 0 else 1,
    )


def build_drafter(demo: Path, out: Path, preset: DemoPreset) -> Path:
    """The untrained drafter with the demo's tokenizer, saved like any checkpoint."""
    from transformers import AutoTokenizer

    from marslm.experiments.toy_model import make_tiny_qwen2
    from marslm.modeling import count_parameters

    tokenizer = AutoTokenizer.from_pretrained(demo / "ar")
    model = make_tiny_qwen2(tokenizer, drafter_spec(MODEL_SIZES[preset.model]), seed=preset.seed + 1)
    base = out / "drafter-base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    print(f"[drafters] drafter: {count_parameters(model):,} parameters ({preset.model} / {WIDTH_SHARE} wide)")
    return base


def train_drafters(base: Path, out: Path, preset: DemoPreset, progress: bool, stages: Stages) -> None:
    """The demo's two stages on the drafter: AR SFT, then MARS from it."""
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    stages.stage(2, f"AR SFT: {preset.ar_steps} steps of {preset.batch_size}")
    ar = dict(max_steps=preset.ar_steps, learning_rate=preset.ar_lr)
    train(TrainConfig(model=str(base), output=str(out / "drafter-ar"), **ar, **train_arguments(preset, progress, "ar")))
    stages.stage(3, f"MARS (B={preset.block_size}): {preset.mars_steps} steps of {preset.batch_size}")
    mars = dict(
        max_steps=preset.mars_steps,
        learning_rate=preset.mars_lr,
        block_size=preset.block_size,
        ar_weight=preset.mars_ar_weight,
    )
    train(
        TrainConfig(
            model=str(out / "drafter-ar"),
            output=str(out / "drafter-mars"),
            **mars,
            **train_arguments(preset, progress, "mars"),
        )
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo", help="the demo's output folder (marslm demo --out DEMO)")
    parser.add_argument("--out", default=None, help="where the drafters go (default: DEMO)")
    parser.add_argument("--quick", action="store_true", help="tiny data and steps: a smoke run")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    demo = Path(args.demo)
    out = Path(args.out) if args.out else demo
    try:
        preset = demo_preset(demo)
        preset = replace(preset, **QUICK) if args.quick else preset
        stages = Stages("drafters", 3)
        stages.stage(1, f"a drafter {WIDTH_SHARE}x narrower than the demo's '{preset.model}' model")
        base = build_drafter(demo, out, preset)
        train_drafters(base, out, preset, not args.quiet, stages)
    except UserError as exc:
        print(f"toy_drafters: {exc}", file=sys.stderr)
        return 2
    stages.say(f"done in {stages.timings()['total'] / 60:.1f} min: {out / 'drafter-ar'}, {out / 'drafter-mars'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
