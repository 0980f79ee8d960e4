"""MARS on a real model on a GPU, measured end to end in one command of about nine minutes.

    python -m marslm.demo.gpu_campaign --out $OUT/campaign.json   # on the lent GPU machine (docs/gpu.md)
    python -m marslm.demo.gpu_campaign --dry-run --out c.json      # every stage at tiny sizes, on a CPU

The model is SmolLM2-135M-Instruct, carried in parts by the kit (marslm/demo/gpu_kit.py, `make gpu-kit`).
Stages, each recorded in the JSON as it ends (the file is rewritten after every stage, so a run
that is cut off still reports; a stage that fails records its error and the next one runs):

  kit          reassemble the GGUF from its parts (each part's sha256 checked) and put the carried
               wheels (transformers at marslm's pin, gguf) first on sys.path
  environment  versions, the GPU, which transformers was imported from
  convert, distill   the plain HF checkpoint; the original's greedy answers (held-out, then train)
  train_exact, train_full   exact mode and full MARS, each for --train-steps or --train-min, bf16,
               with the probe on a few held-out answers along the way
  probe_exact, probe_full   the probe on every held-out answer (fidelity, tokens per forward)
  decode       marslm (tau 1, 0.95, 0.9, lossless) against HF generate, batch 1 / 8 / 32;
               `same_as_greedy` marks outputs equal to HF greedy (tau 1 and lossless must be)
  probe_*      gpu_probe.py's random-weight sections, cheapest first, as time allows

Without the model (a part missing: the machine was given back between the kit's two calls) the
model stages record that and the probe's sections get the whole budget: the single-call fallback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# The machine has no network: nothing may wait on the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from . import gpu_kit  # noqa: E402  (torch- and transformers-free: nothing is imported before the wheels)

STAGING = Path("/tmp/marslm-gpu-kit")  # where docs/gpu.md's first call leaves its part
GPU = {
    "deadline_min": 8.5,  # the call's timeout_s is 600: room for a stage that overruns
    "distill_min": 1.25,
    "train_min": 1.4,
    "decode_min": 2.0,
    "layers": None,
    "train_prompts": "instructions:14000,toy:2000",
    "heldout": (64, 32),  # held-out instructions, toy items
    "max_new_tokens": 128,
    "distill_batch": 256,
    "distill_chunk": 2048,
    "train": dict(batch_size=32, max_length=512, save_steps=10**6, logging_steps=20, attention="flex"),
    "train_steps": 400,
    "train_file": "train.jsonl",  # the finished answers (distill keeps the cut ones aside)
    "curve_points": 4,
    "decode": {"batch_sizes": (1, 8, 32), "prompts": {1: 2, 8: 8, 32: 32}, "new_tokens": 128, "dtype": "bfloat16"},
    # the probe's sections, cheapest first, with the seconds each needs at least (a guess until measured)
    "probe_sections": (
        ("correctness", 40),
        ("attention", 45),
        ("cost_curve", 60),
        ("generate", 60),
        ("train_step", 150),
    ),
}
DRY = {
    **GPU,
    "deadline_min": 8.0,
    "distill_min": 1.0,
    "train_min": 1.0,
    "decode_min": 1.0,
    "layers": 2,
    "train_prompts": "instructions:6,toy:2",
    "heldout": (3, 1),
    "max_new_tokens": 12,
    "distill_batch": 4,
    "distill_chunk": 4,
    "train": dict(batch_size=4, max_length=96, save_steps=10**6, logging_steps=1, attention="sdpa"),
    # a model cut to 2 layers never ends an answer: the rehearsal trains on the cut ones as if whole
    "train_file": "train.unfinished.jsonl",
    "train_steps": 2,
    "curve_points": 1,
    "decode": {"batch_sizes": (1, 2), "prompts": {1: 1, 2: 2}, "new_tokens": 6, "dtype": "float32"},
    "probe_sections": (("attention", 0),),
}
RECIPES = {  # marslm train's settings per arm, over the plan's "train"
    "exact": dict(exact=True, lora_rank=32, random_phase=True, learning_rate=1e-3),
    "full": dict(learning_rate=5e-5),
}


class Campaign:
    """The run's shared state: the plan, the working folder, the clock and what each stage made."""

    def __init__(self, plan: dict, work: Path, kit: Path, dry_run: bool):
        self.plan, self.work, self.kit, self.dry_run = plan, work, kit, dry_run
        self.started = time.time()
        self.deadline = self.started + 60 * plan["deadline_min"]
        self.made: dict[str, Path] = {}  # "gguf", "original", "exact", "full"

    def left(self) -> float:
        return self.deadline - time.time()

    def needs(self, *names: str) -> list[Path]:
        missing = [n for n in names if n not in self.made]
        if missing:
            raise RuntimeError(f"no {', '.join(missing)}: an earlier stage failed (see its entry)")
        return [self.made[n] for n in names]

    def preset(self):
        from marslm.demo.smollm2_presets import RealModelPreset

        p = self.plan
        return RealModelPreset(
            train_prompts=p["train_prompts"],
            heldout_instructions=p["heldout"][0],
            heldout_toy=p["heldout"][1],
            max_new_tokens=p["max_new_tokens"],
            train={**p["train"], "max_steps": p["train_steps"], "precision": "bf16"},
            taus=(1.0, 0.95, 0.9),
            curve_points=p["curve_points"],
            distill_batch=p["distill_batch"],
        )


def kit_stage(c: Campaign) -> dict:
    """The GGUF from its parts and the carried wheels on sys.path; the parts' places are listed."""
    places = [c.kit / name for name in gpu_kit.CALLS] + [c.kit, STAGING]
    manifest = next((p / gpu_kit.MANIFEST for p in places if (p / gpu_kit.MANIFEST).is_file()), None)
    result = {"places": [str(p) for p in places if p.is_dir()]}
    result.update(gpu_kit.install_wheels(sorted({w.name: w for p in places for w in p.glob("*.whl")}.values()), c.work))
    if manifest is None:
        raise FileNotFoundError(f"no {gpu_kit.MANIFEST} under {', '.join(map(str, places))}: build the kit")
    name = json.loads(manifest.read_text())["name"]
    c.made["gguf"] = gpu_kit.reassemble(manifest, places, c.work / name)
    result["model"] = {"file": name, "sha256": gpu_kit.sha256(c.made["gguf"])}
    return result


def environment_stage(c: Campaign) -> dict:
    import torch
    import transformers

    from ..bench import gpu_probe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {**gpu_probe.environment(device), "transformers_from": transformers.__file__}


def convert_stage(c: Campaign) -> dict:
    from marslm.convert import convert_gguf

    (gguf,) = c.needs("gguf")
    original = convert_gguf(gguf, c.work / "original", overwrite=True)
    layers = c.plan["layers"]
    if layers is not None:  # the rehearsal: the same tokenizer and architecture, few layers
        original = cut_layers(original, c.work / f"original-{layers}-layers", layers)
    c.made["original"] = original
    return {"checkpoint": str(original), "layers": layers or "all"}


def cut_layers(source: Path, target: Path, layers: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def distill_stage(c: Campaign) -> dict:
    """The held-out answers (the probe's references) whole, then training answers chunk by chunk
    until the stage's minutes are spent."""
    from marslm.data.distilled import read_answers
    from marslm.demo.smollm2_presets import heldout_spec
    from marslm.distill import distill, load_prompts
    from marslm.modeling import load_model, resolve_device

    (original,) = c.needs("original")
    started = time.time()
    preset, folder = c.preset(), c.work / "distill"
    model, tokenizer, _ = load_model(str(original), dtype="float32", device=resolve_device("auto"))
    options = dict(max_new_tokens=preset.max_new_tokens, batch_size=preset.distill_batch, progress=False)
    distill(
        model, tokenizer, load_prompts(heldout_spec(preset), "test", preset.seed), folder / "heldout.jsonl", **options
    )
    prompts = load_prompts(preset.train_prompts, "train", preset.seed)
    until, chunk = started + 60 * c.plan["distill_min"], c.plan["distill_chunk"]
    for first in range(0, len(prompts), chunk):
        if time.time() > until:
            break
        distill(model, tokenizer, prompts[first : first + chunk], folder / "train.jsonl", **options)
    seconds = time.time() - started
    answers = read_answers(folder / "train.jsonl")
    finished = read_answers(folder / "train.jsonl", include_unfinished=False)
    c.made["distill"] = folder
    return {
        "train_prompts": len(prompts),
        "train_answers": len(answers),
        "train_answers_finished": len(finished),
        "answers_per_s": round(len(answers) / seconds, 1),
        "heldout_answers": len(read_answers(folder / "heldout.jsonl")),
        "heldout_answers_finished": len(read_answers(folder / "heldout.jsonl", include_unfinished=False)),
    }


def stop_after(seconds: float):
    """A Trainer callback that ends training once ``seconds`` have passed (the model is then saved)."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.until = time.time() + seconds

        def on_step_end(self, args, state, control, **kwargs):
            if time.time() > self.until:
                control.should_training_stop = True

    return StopAfter()


def train_stage(c: Campaign, arm: str) -> dict:
    """One arm for its steps or minutes; where the plan's attention (FlexAttention) fails, once
    more with sdpa, so that a kernel problem costs the arm's minutes and not its numbers."""
    from dataclasses import replace

    original, data = c.needs("original", "distill")
    preset = c.preset()
    failed = {}
    for attention in dict.fromkeys([preset.train["attention"], "sdpa"]):
        settings = {**preset.train, **RECIPES[arm], "attention": attention}
        try:
            result = train_arm(c, arm, replace(preset, train=settings), original, data)
        except Exception as exc:  # noqa: BLE001 - recorded; sdpa is tried next
            if attention == "sdpa":
                raise
            failed[f"{attention}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            continue
        return {**failed, "attention": attention, **result}
    raise AssertionError("unreachable: the sdpa attempt returns or raises")


def train_arm(c: Campaign, arm: str, preset, original: Path, data: Path) -> dict:
    from dataclasses import asdict

    from marslm.demo.smollm2_measure import heldout_set, learning_curve_callback, learning_curve_points
    from marslm.demo.smollm2_presets import describe, training_config
    from marslm.demo.stages import Stages
    from marslm.training.recipe import train

    out = arm_folder(c, arm)
    model = out / f"model-{preset.train['attention']}"
    cfg = training_config(preset, original, data / c.plan["train_file"], model, progress=False)
    curve = learning_curve_callback(Stages(f"campaign {arm}", 1), out, preset, cfg, heldout_set(out, preset))
    summary = train(cfg, callbacks=[curve, stop_after(60 * c.plan["train_min"])])
    c.made[arm] = model
    return {
        "recipe": describe(cfg),
        "planned_steps": cfg.max_steps,
        "cut_by_budget": summary.steps < cfg.max_steps,
        "summary": asdict(summary),
        "learning_curve": learning_curve_points(out),
    }


def arm_folder(c: Campaign, arm: str) -> Path:
    """``WORK/ARM``, whose ``distill`` is the shared one: the demo's measurements read it there."""
    out = c.work / arm
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "distill").exists():
        (out / "distill").symlink_to(c.work / "distill", target_is_directory=True)
    return out


def probe_stage(c: Campaign, arm: str) -> dict:
    from marslm.demo.smollm2_measure import heldout_set, probe_stage
    from marslm.demo.stages import Stages

    model, original = c.needs(arm, "original")
    out, preset = arm_folder(c, arm), c.preset()
    items = heldout_set(out, preset)
    return probe_stage(Stages(f"campaign probe {arm}", 1), model, original, out, preset, items, progress=False)


def decode_stage(c: Campaign) -> dict:
    """Each trained arm against HF generate on the original, batch by batch, while time is left."""
    from marslm.bench.config import BenchConfig
    from marslm.bench.speed import run_bench
    from marslm.eval.sets import load_eval_set
    from marslm.modeling import load_model, resolve_device

    (original,) = c.needs("original")
    arms = [arm for arm in RECIPES if arm in c.made]
    if not arms:
        raise RuntimeError("no trained model: the training stages failed (see their entries)")
    spec = c.plan["decode"]
    until = time.time() + 60 * c.plan["decode_min"]

    def load(path):
        return load_model(str(path), dtype=spec["dtype"], device=resolve_device("auto"))[:2]

    ar = load(original)
    eval_set = load_eval_set("toy", max(spec["prompts"].values()), seed=0)
    result = {"dtype": spec["dtype"], "new_tokens": spec["new_tokens"]}
    for arm in arms:
        models = {"ar": ar, "mars": load(c.made[arm])}
        for batch in spec["batch_sizes"]:
            if time.time() > until:
                result.setdefault("skipped", []).append(f"{arm} batch {batch}: past the stage's minutes")
                continue
            config = BenchConfig(
                model=str(c.made[arm]),
                ar_model=str(original),
                batch_sizes=[batch],
                n=spec["prompts"][batch],
                repeats=1,
                max_new_tokens=spec["new_tokens"],
                taus=[1.0, 0.95, 0.9],
                contenders=["hf-mars", "cursor", "lossless"],
                progress=False,
            )
            result.setdefault(arm, []).append(run_bench(models, eval_set, config))
    return result


def tables(report: dict) -> str:
    """The campaign's numbers for people (docs/results.md): per arm its training, the probe and
    decoding speed, in the formats `marslm probe` and `marslm bench` print."""
    from marslm.bench.report import format_bench_table
    from marslm.eval.probe_report import format_probe

    sections = report["sections"]
    lines = [f"campaign: dry run {report['dry_run']}, {report['seconds']:.0f} s"]
    for name, section in sections.items():
        if "error" in section or "skipped" in section:
            lines.append(f"- {name}: {section.get('error') or section.get('skipped')}")
    for arm in RECIPES:
        train, probed = sections.get(f"train_{arm}", {}), sections.get(f"probe_{arm}", {})
        lines += ["", f"## {arm}: {train.get('recipe', '-')}"]
        if "summary" in train:
            summary, curve = train["summary"], train["learning_curve"]
            lines.append(
                f"{summary['steps']} of {train['planned_steps']} steps in {summary['seconds']:.0f} s "
                f"({train['attention']}), final loss {summary['final_loss']:.3f}; lossless tokens per forward "
                f"(teacher-forced, {curve[0]['items'] if curve else 0} held-out answers) by step: "
                + ", ".join(f"{p['step']}: {p['tokens_per_forward_lossless_tf']:.2f}" for p in curve)
            )
        if "fidelity" in probed:
            lines += ["", format_probe(probed)]
        for bench in sections.get("decode", {}).get(arm, []):
            lines += ["", format_bench_table(bench)]
    return "\n".join(lines)


def probe_sections(c: Campaign, report) -> None:
    """gpu_probe.py's sections, cheapest first, each when the seconds it needs are left."""
    import torch

    from ..bench import gpu_probe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = gpu_probe.DRY if c.dry_run else gpu_probe.FULL
    tok = None
    for name, need in c.plan["probe_sections"]:
        if c.left() < need:
            report.data["sections"][f"probe_{name}"] = {"skipped": f"{c.left():.0f} s left, it needs about {need}"}
            continue
        if name in ("correctness", "generate") and tok is None:
            tok = gpu_probe.tokenizer()
        args = {
            "correctness": (device, plan, tok),
            "attention": (device, plan),
            "train_step": (device, plan),
            "cost_curve": (device, plan),
            "generate": (device, plan, tok),
        }[name]
        section = {"cost_curve": gpu_probe.cost_curve_section, "generate": gpu_probe.generate_section}.get(
            name, getattr(gpu_probe, name, None)
        )
        report.run(f"probe_{name}", section, *args)


def run(c: Campaign, out: Path) -> dict:
    from ..bench.gpu_probe import Report

    report = Report(out, {"deadline_s": 60 * c.plan["deadline_min"]}, c.dry_run)
    report.data["plan"] = {k: v for k, v in c.plan.items() if k != "probe_sections"}
    stages = [
        ("kit", kit_stage),
        ("environment", environment_stage),
        ("convert", convert_stage),
        ("distill", distill_stage),
        ("train_exact", lambda c: train_stage(c, "exact")),
        ("train_full", lambda c: train_stage(c, "full")),
        ("probe_exact", lambda c: probe_stage(c, "exact")),
        ("probe_full", lambda c: probe_stage(c, "full")),
        ("decode", decode_stage),
    ]
    for name, stage in stages:
        report.run(name, stage, c)
        if name == "kit" and "gguf" not in c.made:
            report.data["fallback"] = "no model (see kit): the model stages fail at once, the probe gets the time"
    probe_sections(c, report)
    return report.data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "campaign.json"))
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on any machine: checks the campaign")
    parser.add_argument("--kit", default=str(gpu_kit.ROOT / "gpu-kit"), help="the carry kit (make gpu-kit)")
    parser.add_argument("--work", default="/tmp/marslm-campaign", help="checkpoints and data (emptied first)")
    for key in ("deadline_min", "distill_min", "train_min", "decode_min"):
        parser.add_argument("--" + key.replace("_", "-"), type=float, help=f"minutes (default: {GPU[key]} on a GPU)")
    parser.add_argument("--train-steps", type=int, help=f"steps per arm (default: {GPU['train_steps']} on a GPU)")
    parser.add_argument("--table", metavar="JSON", help="print a finished campaign's JSON as tables, and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(tables(json.loads(Path(args.table).read_text())))
        return 0
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print("no CUDA device: run with --dry-run to check the campaign on a CPU", file=sys.stderr)
        return 2
    plan = dict(DRY if args.dry_run else GPU)
    plan.update({k: v for k, v in vars(args).items() if k in plan and v is not None})
    work = Path(args.work)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    os.environ.setdefault("MARSLM_CACHE", str(work / "cache"))
    kit = Path(args.kit)
    if args.dry_run and not any(kit.glob(f"*/{gpu_kit.MANIFEST}")):
        from marslm.convert import smollm2_gguf  # torch- and transformers-free

        kit = work / "kit"
        gpu_kit.split(smollm2_gguf(), kit)
    run(Campaign(plan, work, kit, args.dry_run), Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
