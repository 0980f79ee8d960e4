"""Does full MARS keep the model? Task quality against the original and an AR control, paired.

    python scripts/full_mode_quality.py --demo runs/smollm2-demo            # rerun to resume
    python scripts/full_mode_quality.py --demo runs/smollm2-demo --toy 300 --steps 80

The recipe ruling judges full MARS (every weight trains) as the paper does: task quality on held-out
items against the original and against an AR control trained on the same data and steps, with
paired intervals. Two arms train on the SmolLM2 preset's distilled answers (``marslm demo --preset
smollm2`` writes OUT/original and OUT/distill), with the same data, steps, batch and learning rate:

  mars      full MARS as ``marslm train mars`` runs it by default on distilled answers (the KL
            anchor to the original on the clean stream)
  control   stage ar with the same clean-stream targets: the MARS run without its masks

Then the original, the control and MARS decode one token per forward (tau 1, greedy) on held-out
toy items, graded, and on the preset's held-out instructions, where "right" is the original's own
answer. Reported per model: accuracy, the paired bootstrap interval of each difference, and,
teacher-forced on the held-out answers, the clean stream's top-1 agreement with the original and
the mean KL(original || model) per answer token, beside the original's own under bf16 rounding.
Output: DEMO/quality/report.json and report.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS.parent), str(SCRIPTS)]

from ablate_smollm2 import COMMON  # noqa: E402  (the ablation's recipe: B, batch, length, bf16, schedule)

ARMS = {
    "mars": dict(stage="mars", soft_clean=None),  # None: train's default (the anchor, on distilled data)
    "control": dict(stage="ar", soft_clean=1.0),
}


def train_arm(name: str, demo: Path, out: Path, steps: int, learning_rate: float) -> Path:
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    model_dir = out / name
    if not (model_dir / "config.json").is_file():
        settings = {**COMMON, **ARMS[name], "learning_rate": learning_rate}
        if settings["stage"] == "ar":
            settings.pop("block_size")
        train(
            TrainConfig(
                model=str(demo / "original"),
                data=str(demo / "distill" / "train.jsonl"),
                output=str(model_dir),
                max_steps=steps,
                **settings,
            )
        )
    return model_dir


def answer_logprobs(model, items, autocast: bool = False):
    """Per item, the log-probabilities the model gives each answer token's position (teacher-forced)."""
    import torch

    rows = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for item in items:
            ids = torch.tensor([item.prompt_ids + item.answer_ids])
            logits = model(input_ids=ids).logits[0, len(item.prompt_ids) - 1 : -1].float()
            rows.append(torch.log_softmax(logits, dim=-1))
    return rows


def closeness(original_rows, rows, items) -> dict:
    """Top-1 agreement with the original's answer tokens, and the mean KL(original || model) per token."""
    import torch

    agree = kl = tokens = 0
    for ref, mine, item in zip(original_rows, rows, items, strict=True):
        target = torch.tensor(item.answer_ids)
        agree += int((mine.argmax(-1) == target).sum())
        # a mask row the tuned model grew is outside the original's support: it only lowers mine
        kl += float((ref.exp() * (ref - mine[:, : ref.shape[-1]])).sum())
        tokens += len(item.answer_ids)
    return {"top1_agreement": agree / tokens, "kl_per_token": kl / tokens, "tokens": tokens}


def measure(models: dict[str, Path], demo: Path, toy: int, out: Path) -> dict:
    import torch

    from marslm.eval.evaluate import evaluate
    from marslm.eval.probe_items import load_probe_items
    from marslm.eval.sets import load_eval_set
    from marslm.modeling import load_model

    sets = [load_eval_set("toy", n=toy), load_eval_set(f"answers:{demo / 'distill' / 'heldout.jsonl'}")]
    report, original_rows = {}, None
    for name, path in models.items():
        done = out / f"measured-{name}.json"
        model, tokenizer, _ = load_model(str(path), dtype=torch.float32)
        model.eval()
        items = load_probe_items(demo / "distill" / "heldout.jsonl", tokenizer)
        rows = answer_logprobs(model, items)
        entry = {"decoded": {}}
        if original_rows is None:
            original_rows = rows
            entry["teacher_forced"] = closeness(original_rows, answer_logprobs(model, items, autocast=True), items)
            entry["teacher_forced"]["what"] = "the original under bf16 autocast: rounding's own level"
        else:
            entry["teacher_forced"] = closeness(original_rows, rows, items)
        for eval_set in sets:
            result = evaluate(model, tokenizer, eval_set, taus=(1.0,), progress=False, model_name=name)
            entry["decoded"][eval_set.name] = result["results"][0]
        report[name] = entry
        done.write_text(json.dumps(entry) + "\n")
        print(f"[quality] measured {name}", flush=True)
    return report


def paired(report: dict) -> list[dict]:
    from marslm.eval.report import paired_bootstrap

    rows = []
    for a, b in (("mars", "original"), ("mars", "control"), ("control", "original")):
        for data, cell in report[a]["decoded"].items():
            other = report[b]["decoded"][data]
            low, high = paired_bootstrap(cell["correct"], other["correct"])
            gap = 100 * (cell["accuracy"] - other["accuracy"])
            rows.append({"a": a, "b": b, "data": data, "gap_points": gap, "interval": [low, high]})
    return rows


def markdown(report: dict, gaps: list[dict]) -> str:
    datas = list(report["original"]["decoded"])
    lines = [
        "| model | "
        + " | ".join(f"{d} (n={report['original']['decoded'][d]['n']})" for d in datas)
        + " | teacher-forced top-1 = original | KL(original || model) per token |",
        "|---|" + "---|" * (len(datas) + 2),
    ]
    for name, entry in report.items():
        tf = entry["teacher_forced"]
        cells = " | ".join(f"{100 * entry['decoded'][d]['accuracy']:.1f}%" for d in datas)
        label = "original (bf16 rounding)" if name == "original" else name
        lines.append(f"| {label} | {cells} | {100 * tf['top1_agreement']:.1f}% | {tf['kl_per_token']:.4f} |")
    lines += ["", "| difference | data | points | 95% paired interval |", "|---|---|---|---|"]
    for g in gaps:
        low, high = g["interval"]
        lines.append(f"| {g['a']} - {g['b']} | {g['data']} | {g['gap_points']:+.1f} | [{low:+.1f}, {high:+.1f}] |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", default="runs/smollm2-demo", help="the preset's output: original/ and distill/")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per arm (batch 8)")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="both arms' (the ablation's best full arm)")
    parser.add_argument("--toy", type=int, default=300, help="held-out toy items decoded per model")
    parser.add_argument("--out", default=None, help="where the arms and the report go (default DEMO/quality)")
    args = parser.parse_args(argv)
    demo = Path(args.demo)
    if not (demo / "distill" / "heldout.jsonl").is_file():
        print(f"{demo}/distill/heldout.jsonl: run the preset's distill first", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else demo / "quality"
    models = {"original": demo / "original"}
    models |= {name: train_arm(name, demo, out, args.steps, args.learning_rate) for name in ARMS}
    report = measure(models, demo, args.toy, out)
    gaps = paired(report)
    payload = {"steps": args.steps, "learning_rate": args.learning_rate, "models": report, "paired": gaps}
    (out / "report.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report, gaps))
    print(markdown(report, gaps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
