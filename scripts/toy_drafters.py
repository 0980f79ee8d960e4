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

from marslm.demo.presets import DemoPreset, stage_configs
from marslm.demo.stages import Stages
from marslm.demo.toy import DEMO_MARKER
from marslm.demo.toy_model import MODEL_SIZES, TinyModelSpec
from marslm.errors import UserError

# --quick: enough to run every stage, nothing to learn from
QUICK = dict(train_examples=64, batch_size=8, ar_steps=12, mars_steps=6)
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

    from marslm.demo.toy_model import make_tiny_qwen2
    from marslm.modeling import count_parameters

    tokenizer = AutoTokenizer.from_pretrained(demo / "ar")
    model = make_tiny_qwen2(tokenizer, drafter_spec(MODEL_SIZES[preset.model]), seed=preset.seed + 1)
    base = out / "drafter-base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    print(f"[drafters] drafter: {count_parameters(model):,} parameters ({preset.model} / {WIDTH_SHARE} wide)")
    return base


def quick(preset: DemoPreset) -> DemoPreset:
    """``preset`` cut to QUICK's sizes."""
    return replace(
        preset,
        train_examples=QUICK["train_examples"],
        train={**preset.train, "batch_size": QUICK["batch_size"]},
        ar={**preset.ar, "max_steps": QUICK["ar_steps"]},
        after_ar={**preset.after_ar, "max_steps": QUICK["mars_steps"]},
    )


def train_drafters(base: Path, out: Path, preset: DemoPreset, progress: bool, stages: Stages) -> None:
    """The demo's AR and MARS stages on the drafter: its configs, another model and output."""
    from marslm.training.recipe import train

    configs = stage_configs(preset, out, progress)
    ar = replace(configs["ar"], model=str(base), output=str(out / "drafter-ar"))
    mars = replace(configs["mars"], model=str(out / "drafter-ar"), output=str(out / "drafter-mars"))
    stages.stage(2, f"AR SFT: {ar.max_steps} steps of {ar.batch_size}")
    train(ar)
    stages.stage(3, f"MARS (B={mars.block_size}): {mars.max_steps} steps of {mars.batch_size}")
    train(mars)


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
        preset = quick(preset) if args.quick else preset
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
