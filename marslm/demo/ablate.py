"""``marslm ablate``: the paper's comparison set (Tables 2-3), on the embedded toy suite.

Configurations, in the order they run (N = the steps of the preset's AR stage):

    AR N                 stage 1, AR SFT for N steps: the control every other row starts from
    AR 2N                AR N trained N more steps (continued, as the paper's "continuing AR SFT
                         for 5 more epochs"; a fresh warm-up + cosine schedule): is MARS's gain compute?
    MARS B=b w=1         MARS from AR N at each block size b, with the AR (clean-stream) loss term
    MARS B=b w=0         ... and without it (the paper's "MARS w/o SFT loss"), each sequence's
                         masked-stream loss weighted 1/t, t ~ U(0.001, 1), as the reference trains it
    Jacobi (AR N)        training-free multi-token baseline on AR N

AR rows are evaluated at tau 1; MARS rows at tau 1, 0.95, 0.9, 0.8 with their own block size;
Jacobi is greedy (its output equals AR N's) and reports its tokens per forward.

Outputs: ``OUT/<slug>/`` per trained configuration (``ar_n``, ``ar_2n``, ``mars_b4_w1``, ...),
``OUT/ablation.json`` (``{label: eval report}`` plus ``preset``; ``marslm plot`` reads it),
``OUT/ablation.md`` (the table) and ``OUT/frontier.png``.

Resumable one configuration at a time: a checkpoint directory exists only once its training
finished (``train`` renames it into place), so an existing one is not retrained, and a label
already in ablation.json is not re-evaluated.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError
from ..eval.evaluate import evaluate
from ..eval.report import summarise_result
from ..eval.sets import load_eval_set
from ..files import output_directory, read_json, write_json_atomically, write_text_atomically
from ..training.recipe import train
from .presets import DemoPreset, resolve_preset, stage_config, stage_configs
from .toy import build_base_model

DEFAULT_BLOCK_SIZES = (4, 8, 16)
MARS_TAUS = (1.0, 0.95, 0.9, 0.8)
FAST_TAU = 0.95  # the tau of the table's speed columns, as the paper's Tables 2-3
JACOBI_WINDOW = 4


@dataclass(frozen=True)
class Configuration:
    label: str  # the row name, and the key in ablation.json
    slug: str  # its directory under OUT
    kind: str  # "ar", "mars" or "jacobi"
    start_from: str  # slug of the checkpoint it trains (or decodes) from; "base" for AR N
    steps: int = 0
    block_size: int = 1
    ar_weight: float = 1.0


def _demo_stages(preset: DemoPreset) -> dict:
    """The demo's stages at ``preset``: AR N is its AR stage, and every MARS row trains as its MARS
    stage does (steps, schedule, sequence length) but for the block size and loss weights."""
    return stage_configs(preset, Path(), progress=False)


def plan(preset: DemoPreset, block_sizes=DEFAULT_BLOCK_SIZES) -> list[Configuration]:
    """Every configuration, in an order where each one's starting checkpoint comes first."""
    demo = _demo_stages(preset)
    n = demo["ar"].max_steps
    configs = [
        Configuration("AR N", "ar_n", "ar", "base", steps=n),
        Configuration("AR 2N", "ar_2n", "ar", "ar_n", steps=n),
    ]
    for block in block_sizes:
        for weight in (1, 0):
            configs.append(
                Configuration(
                    f"MARS B={block} w={weight}",
                    f"mars_b{block}_w{weight}",
                    "mars",
                    "ar_n",
                    steps=demo["mars"].max_steps,
                    block_size=block,
                    ar_weight=float(weight),
                )
            )
    configs.append(Configuration("Jacobi (AR N)", "ar_n", "jacobi", "ar_n", block_size=JACOBI_WINDOW))
    return configs


def _say(message: str) -> None:
    print(f"[ablate] {message}", flush=True)


def _is_finished_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "marslm.json").is_file()


def _train_configuration(config: Configuration, out: Path, preset: DemoPreset, progress: bool) -> None:
    if config.kind == "ar":
        settings = {**preset.ar, "max_steps": config.steps}
    else:
        settings = {
            **preset.after_ar,
            "stage": "mars",
            "max_steps": config.steps,
            "block_size": config.block_size,
            "ar_weight": config.ar_weight,
            "masked_weighting": "inverse-t" if config.ar_weight == 0 else "uniform",
        }
    train(stage_config(preset, out / config.start_from, out / config.slug, progress, settings))


def jacobi_report(model, tokenizer, eval_set, window: int, max_new_tokens: int, model_name: str) -> dict:
    """An eval report (one cell) for Jacobi decoding, shaped like :func:`marslm.eval.evaluate.evaluate`'s."""
    from ..decode.jacobi import jacobi_generate

    prompts = [ex.messages for ex in eval_set.examples]
    started = time.perf_counter()
    out = jacobi_generate(model, tokenizer, prompts, window=window, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - started
    correct = eval_set.score_many(eval_set.examples, out.texts)
    cell = summarise_result(eval_set.examples, correct, out.accepted_per_step, seconds)
    # mode "jacobi" keeps the plot from taking it for the AR baseline (that rule wants threshold tau=1).
    cell.update(tau=1.0, metric="greedy", block_size=window, mode="jacobi")
    return {"model": model_name, "data": eval_set.name, "results": [cell]}


def _evaluate_configuration(config: Configuration, out: Path, eval_set, preset: DemoPreset, progress: bool) -> dict:
    from ..modeling import load_model

    path = out / config.slug
    model, tokenizer, _ = load_model(str(path))
    max_new_tokens = _demo_stages(preset)["mars"].max_length
    if config.kind == "jacobi":
        return jacobi_report(model, tokenizer, eval_set, config.block_size, max_new_tokens, str(path))
    taus = (1.0,) if config.kind == "ar" else MARS_TAUS
    return evaluate(
        model,
        tokenizer,
        eval_set,
        taus=taus,
        block_size=config.block_size,
        max_new_tokens=max_new_tokens,
        progress=progress,
        model_name=str(path),
    )


# ---------------------------------------------------------------------------- the table


def _cell(report: dict, tau: float) -> dict | None:
    return next((c for c in report["results"] if c["tau"] == tau and "failed" not in c), None)


def format_ablation_table(reports: dict[str, dict]) -> str:
    """Rows = configurations; accuracy per family and overall at tau 1, then accuracy and tokens per
    forward at tau 0.95 (MARS only: AR decodes one token per forward, Jacobi has no tau)."""
    families = sorted({f for rep in reports.values() for c in rep["results"] for f in c.get("families", {})})
    head = ["configuration", *families, "overall", "tok/fwd", f"overall τ={FAST_TAU}", f"tok/fwd τ={FAST_TAU}"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for label, rep in reports.items():
        exact, fast = _cell(rep, 1.0), _cell(rep, FAST_TAU)
        row = [label]
        if exact is None:
            row += ["-"] * (len(families) + 2)
        else:
            row += [
                f"{100 * exact['families'][f]['accuracy']:.1f}" if f in exact["families"] else "-" for f in families
            ]
            row += [f"{100 * exact['accuracy']:.1f}", f"{exact['tokens_per_forward']:.2f}"]
        row += [f"{100 * fast['accuracy']:.1f}", f"{fast['tokens_per_forward']:.2f}"] if fast else ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _markdown(reports: dict[str, dict], preset: DemoPreset, n_test: int) -> str:
    demo = _demo_stages(preset)
    ar, mars = demo["ar"], demo["mars"]
    return (
        f"# MARS ablation on the toy suite\n\n"
        f"N = {ar.max_steps} AR SFT steps of {ar.batch_size}; every MARS row trains "
        f"{mars.max_steps} steps from AR N; AR 2N continues AR N for N more steps. "
        f"w = weight of the AR (clean-stream) loss term. Test items: {n_test}. Accuracy in percent; "
        f"tok/fwd = decoded tokens per forward pass. Jacobi (window {JACOBI_WINDOW}) decodes AR N "
        f"greedily, so its accuracy equals AR N's; its speed is its tok/fwd in the τ=1 columns.\n\n"
        f"{format_ablation_table(reports)}\n"
    )


def _write_outputs(out: Path, reports: dict[str, dict], preset: DemoPreset, n_test: int) -> None:
    write_json_atomically(out / "ablation.json", {**reports, "preset": asdict(preset)})
    write_text_atomically(out / "ablation.md", _markdown(reports, preset, n_test))


def _plot(out: Path) -> Path:
    from ..eval.plots import load_series, plot_frontier

    return plot_frontier(
        load_series([str(out / "ablation.json")]),
        out / "frontier.png",
        title="MARS ablation: accuracy vs tokens per forward (toy suite)",
    )


# ---------------------------------------------------------------------------- the run


def run_ablation(
    out: str | Path = "runs/ablate",
    preset: str | DemoPreset = "default",
    block_sizes=DEFAULT_BLOCK_SIZES,
    progress: bool = True,
    **overrides,
) -> dict:
    """Train and evaluate every configuration of :func:`plan`; returns ``{label: eval report}``.

    ``overrides`` replace fields of the preset (e.g. ``test_examples=8`` for a smoke run).
    """
    preset = resolve_preset(preset, **overrides)
    block_sizes = tuple(block_sizes)
    if not block_sizes or min(block_sizes) < 1:
        raise UserError(f"block sizes must be >= 1, got {block_sizes}")
    out = output_directory(out, "--out")
    previous = {}
    if (out / "ablation.json").is_file():
        saved = read_json(out / "ablation.json", hint="; remove it or use a new --out")
        if not isinstance(saved, dict):
            raise UserError(
                f"{out / 'ablation.json'} holds a {type(saved).__name__}, not an ablation; remove it or use a new --out"
            )
        if saved.get("preset") not in (None, json.loads(json.dumps(asdict(preset)))):
            # Mixing rows of different presets would make the table meaningless.
            raise UserError(f"{out} holds an ablation with another preset; use a new --out")
        previous = {k: v for k, v in saved.items() if isinstance(v, dict) and "results" in v}
    out.mkdir(parents=True, exist_ok=True)

    if not (out / "base" / "config.json").is_file() or not (out / "base" / "tokenizer_config.json").is_file():
        _say("building the toy suite, tokenizer and base model")
        build_base_model(out, preset)
    eval_set = load_eval_set("toy", preset.test_examples, seed=preset.seed)

    configs = plan(preset, block_sizes)
    reports: dict[str, dict] = {}
    for index, config in enumerate(configs, 1):
        step = f"{index}/{len(configs)} {config.label}"
        finished = config.kind == "jacobi" or _is_finished_checkpoint(out / config.slug)
        if finished and config.label in previous:
            _say(f"{step}: done earlier, skipped")
            reports[config.label] = previous[config.label]
            continue
        if not finished:
            _say(f"{step}: training ({config.steps} steps from {config.start_from})")
            _train_configuration(config, out, preset, progress)
        _say(f"{step}: evaluating on {len(eval_set.examples)} test items")
        reports[config.label] = _evaluate_configuration(config, out, eval_set, preset, progress)
        _write_outputs(
            out, reports | {k: v for k, v in previous.items() if k not in reports}, preset, len(eval_set.examples)
        )

    # Rewrite in plan order (a resumed run may have found them in another order).
    _write_outputs(out, reports, preset, len(eval_set.examples))
    _plot(out)
    _say("results\n" + format_ablation_table(reports))
    _say(f"wrote {out / 'ablation.json'}, {out / 'ablation.md'}, {out / 'frontier.png'}")
    return reports
