"""The SmolLM2 recipe ablation: which lever makes a real model learn MARS and stay itself.

    python scripts/ablate_smollm2.py                       # every arm, in turn; rerun to resume
    python scripts/ablate_smollm2.py --arms top16-masklr   # some arms

Every arm fine-tunes SmolLM2-135M-Instruct with MARS on the same self-distilled answers (the
preset's, ``marslm demo --preset smollm2`` writes them: OUT/original and OUT/distill), for the
same number of steps, then ``marslm probe`` measures it on the held-out answers: the clean
stream's top-1 agreement with the original (fidelity) and the teacher-forced tokens per forward
in the paper's metric and lossless. A finished arm is skipped when rerun; an interrupted one
resumes from its checkpoints. Results: OUT/ablation/<arm>/probe.json and OUT/ablation/table.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The common recipe; each arm changes a few of these. B = 4, packed rows, the distilled token ids.
COMMON = dict(
    block_size=4,
    batch_size=8,
    grad_accum=1,
    max_length=256,
    packing=True,
    precision="bf16",
    lr_schedule="cosine",
    warmup_ratio=0.05,
    save_steps=20,
    logging_steps=10,
    soft_clean=0.0,  # the anchor only where an arm names it (full mode's default on distilled data)
)
# Exact mode's common settings: its own learning rate (the adapter starts from zero).
EXACT = dict(exact=True, learning_rate=1e-3)
ARMS = {
    "top16-lr3e-4": ("the previous preset: top 16 of 30 layers, lr 3e-4", dict(train_layers=16, learning_rate=3e-4)),
    "all-lr5e-5": ("every weight, the mask row included, lr 5e-5", dict(learning_rate=5e-5)),
    "top16-masklr": (
        "top 16 layers at lr 1e-4, the mask row at 1e-3",
        dict(train_layers=16, learning_rate=1e-4, mask_lr=1e-3),
    ),
    "lora32-masklr": (
        "LoRA rank 32 on every layer at lr 5e-4, the mask row at 1e-3",
        dict(lora_rank=32, learning_rate=5e-4, mask_lr=1e-3),
    ),
    "mask-only": ("only the mask row, lr 5e-3", dict(mask_only=True, learning_rate=5e-3)),
    "top16-masklr-B2": (
        "top16-masklr with B = 2",
        dict(train_layers=16, learning_rate=1e-4, mask_lr=1e-3, block_size=2),
    ),
    "top16-masklr-ar4": (
        "top16-masklr with the clean stream's loss weighted 4",
        dict(train_layers=16, learning_rate=1e-4, mask_lr=1e-3, ar_weight=4.0),
    ),
    "all-kl": (
        "all-lr5e-5 with the clean stream's targets the original's distribution (KL anchor)",
        dict(learning_rate=5e-5, soft_clean=1.0),
    ),
    "all-kl-soft": (
        "all-kl, the masks' targets half the original's distribution",
        dict(learning_rate=5e-5, soft_clean=1.0, soft_masked=0.5),
    ),
    "all-kl-soft-lr1e-5": (
        "all-kl-soft at lr 1e-5",
        dict(learning_rate=1e-5, soft_clean=1.0, soft_masked=0.5),
    ),
    "all-kl-soft-lr2e-6": (
        "all-kl-soft at lr 2e-6",
        dict(learning_rate=2e-6, soft_clean=1.0, soft_masked=0.5),
    ),
    "top16-masklr-cut": (
        "top16-masklr with the cut answers kept as truncated examples",
        dict(train_layers=16, learning_rate=1e-4, mask_lr=1e-3, cut_answers=True),
    ),
    "all-lr5e-6": ("every weight at the paper's lr 5e-6", dict(learning_rate=5e-6)),
    "all-kl-lr5e-6": ("every weight at lr 5e-6, with the KL anchor", dict(learning_rate=5e-6, soft_clean=1.0)),
    # Exact mode (train --exact): the model frozen, an adapter at mask positions only.
    "x-row": ("exact: one shared mask row", dict(EXACT, mask_rows="shared", lora_rank=0, learning_rate=5e-3)),
    "x-rows": ("exact: a mask row per offset", dict(EXACT, lora_rank=0, learning_rate=5e-3)),
    "x-r8": ("exact: rows + gated LoRA rank 8", dict(EXACT, lora_rank=8)),
    "x-r32": ("exact: rows + gated LoRA rank 32", dict(EXACT, lora_rank=32)),
    "x-r64": ("exact: rows + gated LoRA rank 64", dict(EXACT, lora_rank=64)),
    "x-r32-phase": ("x-r32 with random block phases", dict(EXACT, lora_rank=32, random_phase=True)),
    "x-r32-phase-s4": (
        "x-r32-phase with 4 noisy copies per row (every token at every offset)",
        dict(EXACT, lora_rank=32, random_phase=True, masked_streams=4),
    ),
    "x-r32-phase-soft": (
        "x-r32-phase with the masks' targets half the frozen model's distribution",
        dict(EXACT, lora_rank=32, random_phase=True, soft_masked=0.5),
    ),
    "x-r32-phase-decay": (
        "x-r32-phase with offset weights 0.7^offset",
        dict(EXACT, lora_rank=32, random_phase=True, offset_decay=0.7),
    ),
    "x-r32-phase-lr3e-4": ("x-r32-phase at lr 3e-4", dict(EXACT, lora_rank=32, random_phase=True, learning_rate=3e-4)),
    "x-r32-phase-B2": ("x-r32-phase with B = 2", dict(EXACT, lora_rank=32, random_phase=True, block_size=2)),
    "x-r32-phase-B3": ("x-r32-phase with B = 3", dict(EXACT, lora_rank=32, random_phase=True, block_size=3)),
}


def run_arm(name: str, out: Path, demo: Path, steps: int, probe_limit: int | None) -> dict:
    import torch

    from marslm.eval.probe import probe
    from marslm.eval.probe_items import load_probe_items
    from marslm.modeling import checkpoint_facts, load_model
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    what, options = ARMS[name]
    arm = out / name
    arm.mkdir(parents=True, exist_ok=True)
    model_dir = arm / "model"
    started = time.time()
    if not (model_dir / "config.json").is_file():
        cfg = TrainConfig(
            stage="mars",
            model=str(demo / "original"),
            data=str(demo / "distill" / "train.jsonl"),
            output=str(model_dir),
            max_steps=steps,
            **{**COMMON, **options},
        )
        train(cfg)
    train_seconds = time.time() - started
    model, tokenizer, _ = load_model(str(model_dir), dtype=torch.float32)
    facts = checkpoint_facts(model, tokenizer)
    items = load_probe_items(demo / "distill" / "heldout.jsonl", tokenizer, limit=probe_limit)
    report = probe(
        model, items, block_size=facts.block_size, mask_token_id=facts.mask_token_id, pad_id=facts.pad_id, batch_size=8
    )
    report.update(arm=name, what=what, options={**COMMON, **options}, steps=steps, train_seconds=round(train_seconds))
    (arm / "probe.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def table(reports: list[dict]) -> str:
    lines = [
        "| arm | what | fidelity (clean top-1) | tok/fwd paper-tf 0.95 | 0.9 | lossless-tf "
        "| offset-1 top-1 | masked CE | s/example |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        offset1 = next((o for o in r["offsets"] if o["offset"] == 1), {})
        paper = r["tokens_per_forward_paper_tf"]
        lines.append(
            f"| {r['arm']} | {r['what']} | {100 * r['fidelity']['top1_agreement']:.1f}% | "
            f"{paper.get('0.95', float('nan')):.3f} | {paper.get('0.9', float('nan')):.3f} | "
            f"{r['tokens_per_forward_lossless_tf']:.3f} | {100 * offset1.get('top1_accuracy', float('nan')):.1f}% | "
            f"{r['masked_ce']:.3f} | {r['train_seconds'] / (r['steps'] * COMMON['batch_size']):.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", default="runs/smollm2-demo", help="the preset's output: original/ and distill/")
    parser.add_argument("--out", default=None, help="where the arms go (default DEMO/ablation)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per arm (batch 8)")
    parser.add_argument("--probe-limit", type=int, default=None, help="held-out items to probe (default all)")
    args = parser.parse_args(argv)
    demo = Path(args.demo)
    out = Path(args.out) if args.out else demo / "ablation"
    names = args.arms.split(",")
    unknown = [n for n in names if n not in ARMS]
    if unknown or not (demo / "distill" / "train.jsonl").is_file():
        print(f"unknown arms {unknown}" if unknown else f"{demo}/distill/train.jsonl: run the preset's distill first")
        return 2
    reports = []
    for name in names:
        done = out / name / "probe.json"
        report = (
            json.loads(done.read_text()) if done.is_file() else run_arm(name, out, demo, args.steps, args.probe_limit)
        )
        reports.append(report)
        (out / "table.md").write_text(table(reports) + "\n")
        print(table(reports), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
