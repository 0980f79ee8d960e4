"""``marslm demo``: the whole method, end to end, on the embedded default.

    1. the toy instruction suite (generated) and a BPE tokenizer trained on its train split
    2. a small Qwen2 model initialised from scratch, saved as a plain HF directory
    3. stage 1, AR SFT, with a learning curve on held-out items  -> OUT/ar
    4. stage 2, MARS, from the AR checkpoint                     -> OUT/mars
    5. the compute-matched control: the AR checkpoint trained on
       the MARS stage's data, steps and schedule, plain AR loss  -> OUT/ar_control
    6. AR, control and MARS at several tau on the test split     -> OUT/report.json
       (MARS also with the paper's sampler, B candidates per step: the paper's tokens per forward)

Stages 3-5 are the same ``train`` calls a user makes with a hub model; only the starting point
(a from-scratch model instead of a downloaded instruction-tuned one) differs.

The paper compares AR SFT with AR SFT + a MARS stage, so its MARS model has had more training.
The fair baseline for MARS's one-token quality is therefore the control, which had the same: the
demo judges MARS against it, and reports the comparison with the AR parent without judging it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from functools import partial
from pathlib import Path

from ..decode.params import PAPER_RULE
from ..errors import UserError
from ..files import make_directory, output_directory, write_json_atomically
from .presets import DemoPreset, resolve_preset, stage_configs
from .stages import Stages, at_steps, curve_steps, say

_say = partial(say, "demo")


# the MARS model decoded with the paper's sampler: its tokens per forward are the paper's metric
PAPER_SAMPLER = "mars_paper_sampler"


def build_base_model(out: Path, preset: DemoPreset) -> Path:
    """Tokenizer + from-scratch model, saved like any hub checkpoint."""
    from ..data import toy
    from ..data.tokenizer import train_chat_tokenizer
    from ..modeling import count_parameters
    from .toy_model import make_tiny_qwen2

    ar = stage_configs(preset, out, progress=False)["ar"]  # the tokenizer reads the AR stage's data
    examples = toy.make_split("train", ar.data_n, seed=ar.data_seed, weights=ar.data_mix)
    texts = [m["content"] for ex in examples for m in toy.to_chat_record(ex)["messages"]]
    tokenizer = train_chat_tokenizer(texts, vocab_size=preset.vocab_size)
    model = make_tiny_qwen2(tokenizer, preset.model, seed=preset.seed)
    base = out / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    _say(f"tokenizer: {len(tokenizer)} tokens; model: Qwen2 '{preset.model}', {count_parameters(model):,} parameters")
    return base


def _learning_curve_callback(preset: DemoPreset, ar, tokenizer_dir: Path, curve: list):
    """Evaluates greedy accuracy on held-out items a few times during AR training."""
    from transformers import AutoTokenizer

    from ..eval.evaluate import evaluate
    from ..eval.sets import load_eval_set

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eval_set = load_eval_set("toy", preset.curve_items, seed=preset.seed + 1)

    def measure(model, _, step):
        # the model mid-training, a few items: compiling its step would cost more than it saves
        report = evaluate(
            model,
            tokenizer,
            eval_set,
            taus=(1.0,),
            block_size=1,
            progress=False,
            max_new_tokens=ar.max_length,
            compile=False,
        )
        acc = report["results"][0]["accuracy"]
        curve.append(
            {
                "step": step,
                "accuracy": acc,
                "families": {k: v["accuracy"] for k, v in report["results"][0]["families"].items()},
            }
        )
        _say(f"AR step {step}: held-out accuracy {100 * acc:.1f}%")

    return at_steps(curve_steps(ar.max_steps, preset.curve_points), measure)


def _one_token_gap(mars: dict, baseline: dict) -> tuple[float, dict, str]:
    """(overall gap in points, per-family gaps, 'interval' text) of MARS at tau 1 against a baseline."""
    gaps = {
        f: round(100 * (mars["families"][f]["accuracy"] - baseline["families"][f]["accuracy"]), 6)
        for f in baseline["families"]
    }
    overall = round(100 * (mars["accuracy"] - baseline["accuracy"]), 6)
    return overall, gaps, _interval(mars, baseline)


def _interval(a: dict, b: dict) -> str:
    """The paired bootstrap interval of a - b over the test items, when both carry per-item scores."""
    from ..eval.report import paired_bootstrap

    if not a.get("correct") or len(a["correct"]) != len(b.get("correct") or []):
        return ""
    low, high = paired_bootstrap(a["correct"], b["correct"])
    return f" (95% CI {low:+.1f} to {high:+.1f} over items)"


def check_results(report: dict) -> list[dict]:
    """The project's demo targets, checked on a demo report; one entry each: what, met, the numbers.

    Result 1 is judged against the compute-matched control (``ar_control``); the same comparison
    with the AR parent is reported with ``met`` None. Result 3 (an AR stage at its plateau) is not
    a verdict a single run can give: the held-out curve also flattens when a cosine schedule ends,
    so the report keeps the curve and this check only quotes its last gain. Intervals are paired
    bootstraps over the test items: a 500-item score moves by about a point and a half with the
    items drawn.
    """
    ar = report["ar"]["results"][0]
    control = report["ar_control"]["results"][0] if "ar_control" in report else None
    mars = {r["tau"]: r for r in report["mars"]["results"]}
    checks = [_check_ar(ar)]
    if 1.0 in mars:
        checks += _check_one_token(mars[1.0], control, ar)
        if 0.95 in mars:
            checks.append(_check_speed(mars[0.95], mars[1.0]))
    curve = report.get("ar_learning_curve") or []
    if len(curve) >= 2:
        checks.append(_quote_plateau(curve))
    return checks


def _check_ar(ar: dict) -> dict:
    """Result 0: the AR stage learned the suite."""
    worst = min(ar["families"], key=lambda f: ar["families"][f]["accuracy"])
    return {
        "result": 0,
        "claim": "AR SFT >= 60% overall, no family below 30%",
        "met": ar["accuracy"] >= 0.60 and ar["families"][worst]["accuracy"] >= 0.30,
        "detail": f"AR {100 * ar['accuracy']:.1f}%, lowest family {worst} "
        f"{100 * ar['families'][worst]['accuracy']:.1f}%",
    }


def _check_one_token(one: dict, control: dict | None, ar: dict) -> list[dict]:
    """Result 1: MARS at tau 1 against the control (judged) and the AR parent (reported)."""
    checks = []
    # gaps are rounded: a gap of exactly -2 points must not fail on float noise
    for name, baseline, judged in (
        ("the compute-matched AR control", control, True),
        ("the AR parent (less training: reported, not judged)", ar, False),
    ):
        if baseline is None:
            continue
        overall, gaps, interval = _one_token_gap(one, baseline)
        worst = min(gaps, key=gaps.get)
        checks.append(
            {
                "result": 1,
                "claim": f"MARS at tau 1 >= {name} overall, every family within 2 points",
                "met": (overall >= 0 and gaps[worst] >= -2.0) if judged else None,
                "detail": f"MARS {100 * one['accuracy']:.1f}% vs {100 * baseline['accuracy']:.1f}%, "
                f"{overall:+.1f}{interval}, worst family {worst} {gaps[worst]:+.1f}",
            }
        )
    return checks


def _check_speed(fast: dict, one: dict) -> dict:
    """Result 2: MARS at tau 0.95 is fast and loses little against tau 1."""
    drop = round(100 * (fast["accuracy"] - one["accuracy"]), 6)
    return {
        "result": 2,
        "claim": "MARS at tau 0.95: >= 2.0 tokens per forward, within 2 points of tau 1",
        "met": fast["tokens_per_forward"] >= 2.0 and drop >= -2.0,
        "detail": f"{fast['tokens_per_forward']:.2f} tokens per forward, {drop:+.1f} points{_interval(fast, one)}",
    }


def _quote_plateau(curve: list) -> dict:
    """Result 3: the AR curve's last gain, quoted without a verdict."""
    gain = 100 * (curve[-1]["accuracy"] - curve[-2]["accuracy"])
    return {
        "result": 3,
        "claim": "AR stage at its plateau (one run cannot tell; README)",
        "met": None,
        "detail": f"last {curve[-1]['step'] - curve[-2]['step']} steps: {gain:+.1f} "
        f"points held-out, to {100 * curve[-1]['accuracy']:.1f}%",
    }


def format_checks(checks: list[dict]) -> str:
    verdict = {True: "met", False: "MISSED", None: "not judged here"}
    return "\n".join(f"result {c['result']}: {c['claim']}: {c['detail']} -- {verdict[c['met']]}" for c in checks)


# What run_demo writes in OUT: the marker first, then each stage (with train's OUT.partial and
# OUT.old beside a stage's directory while it runs), the report last.
DEMO_MARKER = "marslm-demo.json"
DEMO_ENTRIES = (
    "base",
    *(f"{stage}{suffix}" for stage in ("ar", "mars", "ar_control") for suffix in ("", ".partial", ".old")),
    "report.json",
    DEMO_MARKER,
)


def prepare_output(out: str | Path, overwrite: bool) -> Path:
    """``out`` ready for a fresh demo. Only with ``overwrite`` is anything deleted, and then only
    the entries a demo writes, in a directory a demo wrote (its marker comes first, so an
    interrupted demo has one too): OUT may be ``.`` or hold the user's own files."""
    out = output_directory(out, "--out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(
                f"{out} is not empty; pass --overwrite to replace an earlier demo's output there "
                f"(only the entries a demo writes: {', '.join(DEMO_ENTRIES)})"
            )
        ours = [out / name for name in DEMO_ENTRIES if (out / name).exists() or (out / name).is_symlink()]
        if ours and not (out / DEMO_MARKER).is_file():
            raise UserError(
                f"{out} holds {ours[0].name} but no {DEMO_MARKER}: not a demo's output, so nothing there is "
                "replaced; choose another --out"
            )
        for path in ours:  # the marker last: a demo interrupted here can still be replaced
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return make_directory(out, "--out")


def run_demo(
    out: str | Path = "runs/demo",
    preset: str | DemoPreset = "default",
    overwrite: bool = False,
    progress: bool = True,
    **overrides,
) -> dict:
    preset = resolve_preset(preset, **overrides)
    out = prepare_output(out, overwrite)
    write_json_atomically(out / DEMO_MARKER, {"preset": asdict(preset)})
    configs = stage_configs(preset, out, progress)
    stages = Stages("demo", 6)
    curve = _train_stages(out, preset, configs, stages)
    stages.stage(5, f"evaluating on {preset.test_examples} test items")
    with stages.timed("eval"):
        reports = _evaluate_stages(out, preset, configs["mars"], progress)
    timings = stages.timings()
    report = {
        **reports,
        "ar_learning_curve": curve,
        "preset": asdict(preset),
        "seconds": timings,
    }
    report["checks"] = check_results(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    table = _results_table(reports, configs["mars"].block_size)
    stages.stage(6, "results\n" + table + "\n" + format_checks(report["checks"]))
    stages.say(f"done in {timings['total'] / 60:.1f} min; report: {out / 'report.json'}")
    return report


def _train_stages(out: Path, preset: DemoPreset, configs: dict, stages: Stages) -> list:
    """Stages 1-4 into OUT: the base model, AR SFT, MARS and the AR control; returns the AR
    stage's learning curve."""
    from ..training.recipe import train

    stages.stage(1, f"suite + tokenizer ({preset.train_examples} train examples)")
    with stages.timed("setup"):
        base = build_base_model(out, preset)

    curve: list = []
    ar, mars = configs["ar"], configs["mars"]
    stages.stage(2, f"AR SFT: {ar.max_steps} steps of {ar.batch_size}")
    with stages.timed("train_ar"):
        train(ar, callbacks=[_learning_curve_callback(preset, ar, base, curve)])

    stages.stage(
        3,
        f"MARS (B={mars.block_size}, SFT-loss weight {mars.ar_weight:g}): {mars.max_steps} steps of {mars.batch_size}",
    )
    with stages.timed("train_mars"):
        train(mars)

    stages.stage(4, "AR control: the AR checkpoint on the MARS stage's data, steps and schedule, plain AR loss")
    with stages.timed("train_control"):
        train(configs["ar_control"])
    return curve


def _evaluate_stages(out: Path, preset: DemoPreset, mars, progress: bool) -> dict:
    """Each checkpoint's report on the test split, by stage name, and the MARS checkpoint's with
    the paper's sampler; every model decodes at the MARS stage's block size and length."""
    from ..eval.evaluate import evaluate
    from ..eval.sets import load_eval_set
    from ..modeling import load_model, resolve_device

    eval_set = load_eval_set("toy", preset.test_examples, seed=preset.seed)
    reports = {}
    for name, taus in (("ar", (1.0,)), ("ar_control", (1.0,)), ("mars", preset.taus)):
        model, tokenizer, _ = load_model(str(out / name), device=resolve_device("auto"))
        reports[name] = evaluate(
            model,
            tokenizer,
            eval_set,
            taus=taus,
            block_size=mars.block_size,
            max_new_tokens=mars.max_length,
            progress=progress,
            model_name=str(out / name),
            **PAPER_RULE,  # the demo's tokens per forward: every step reads its masks
        )
    # Tokens per forward in the paper's metric: its sampler reads B candidates at every step (the AR
    # token and the first B-1 masks), where marslm's default also reads the last mask.
    paper_taus = [tau for tau in preset.taus if tau < 1]
    if paper_taus:
        reports[PAPER_SAMPLER] = evaluate(
            model,  # the MARS checkpoint, loaded last
            tokenizer,
            eval_set,
            taus=paper_taus,
            block_size=mars.block_size,
            max_new_tokens=mars.max_length,
            use_last_mask=False,
            **PAPER_RULE,
            progress=progress,
            model_name=str(out / "mars"),
        )
    return reports


def _results_table(reports: dict, block_size: int) -> str:
    from ..eval.report import format_table

    mars = f"MARS B={block_size}"
    rows = {"AR SFT": reports["ar"], "AR control": reports["ar_control"], mars: reports["mars"]}
    if PAPER_SAMPLER in reports:
        rows[f"{mars}, the paper's sampler (B candidates)"] = reports[PAPER_SAMPLER]
    return format_table(rows)
