"""The SmolLM2 demo's measurements on held-out prompts: the learning curve during training, decoding
at several tau, the probe, decoding speed, and the report that puts them side by side."""

from __future__ import annotations

import time
from pathlib import Path

from ..decode.params import PAPER_RULE
from .smollm2_presets import RealModelPreset, heldout_spec
from .stages import JsonStore, Stages, StepPoints, at_steps, curve_steps


def heldout_set(out: Path, preset: RealModelPreset) -> list[dict]:
    """The held-out prompts with the original model's greedy answers, in prompt order."""
    from ..data.distilled import read_answers
    from ..distill import load_prompts

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


# How the demo decodes, spelled out for the report: every step reads its masks (the paper's rule, not
# marslm's default fallback), and the last mask too (B+1 candidates, where the paper's sampler reads B).
DECODING = {**PAPER_RULE, "use_last_mask": True}
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
        "by_family": {family: _family_result(out, rows, references) for family, rows in families(items).items()},
        "texts": out.texts,
    }


def _family_result(out, rows: list[int], references: list[list[int]]) -> dict:
    return {
        "n": len(rows),
        "tokens": sum(sum(out.accepted_per_step[i]) for i in rows),
        "forwards": sum(out.forwards[i] for i in rows),
        "tokens_per_forward": out.tokens_per_forward_of(rows),
        **agreement([out.token_ids[i] for i in rows], [references[i] for i in rows]),
    }


def family_of(item: dict) -> str:
    """``source/family``: distilled prompts' ids are ``<family>-<hash>`` (data/instructions.py, data/toy.py)."""
    return f"{item['source']}/{item['id'].rsplit('-', 1)[0]}"


def families(items: list[dict]) -> dict[str, list[int]]:
    """Family -> the indices of its items, families sorted by name."""
    rows: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        rows.setdefault(family_of(item), []).append(i)
    return dict(sorted(rows.items()))


CURVE_TAU = 0.95


def learning_curve_callback(stages: Stages, out: Path, preset: RealModelPreset, cfg, items: list[dict]):
    """The probe (marslm/eval/probe.py) on a few held-out answers during training: fidelity, tokens per
    forward teacher-forced (the paper's rule at tau 0.95, and lossless) and accuracy per mask offset."""
    from ..chat import stop_token_ids
    from ..data.distilled import read_answers
    from ..eval.probe import probe
    from ..eval.probe_items import probe_item

    curve = StepPoints(out / "learning_curve.json")
    answers = read_answers(out / "distill" / "heldout.jsonl")
    records = [answers[it["id"]] for it in items[: preset.curve_prompts]]
    examples_per_step = cfg.batch_size * cfg.grad_accum

    def measure(model, tokenizer, step):
        if curve.has(step):
            return
        stop = stop_token_ids(tokenizer)
        probe_items = [x for r in records if (x := probe_item(r, tokenizer, r["id"], stop)) is not None]
        result = probe(
            model,
            probe_items,
            block_size=cfg.block_size,
            mask_token_id=mask_token_of(model, tokenizer),
            taus=(CURVE_TAU,),
            pad_id=tokenizer.pad_token_id or 0,
            batch_size=preset.eval_batch,
        )
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
        stages.say(
            f"    step {step} ({step * examples_per_step} examples): "
            f"fidelity {100 * result['fidelity']['top1_agreement']:.1f}%, "
            f"tokens per forward (teacher-forced) {tpf:.2f} at tau {CURVE_TAU:g}, "
            f"{result['tokens_per_forward_lossless_tf']:.2f} lossless ({result['seconds']:.1f} s)"
        )

    return at_steps(curve_steps(cfg.max_steps, preset.curve_points), measure, at_start=True)


def learning_curve_points(out: Path) -> list[dict]:
    return StepPoints(out / "learning_curve.json").value


def mask_token_of(model, tokenizer) -> int:
    """The mask id of a model in training: its adapter's (exact mode), else the tokenizer's."""
    from ..adapter import adapter_of
    from ..mars_json import MASK_TOKEN

    adapter = adapter_of(model)
    return adapter.spec.mask_token_id if adapter is not None else tokenizer.convert_tokens_to_ids(MASK_TOKEN)


def eval_stage(stages: Stages, mars: Path, out: Path, preset: RealModelPreset, items: list[dict]) -> dict:
    """MARS at every tau on the held-out prompts; each finished tau is kept in OUT/eval.json."""
    from ..data import toy
    from ..modeling import checkpoint_facts, load_model, resolve_device

    store = JsonStore(out / "eval.json", {})
    done = store.value
    toy_examples = {ex.id: ex for ex in toy.make_split("test", preset.heldout_toy, seed=preset.seed)}
    toy_items = [i for i, it in enumerate(items) if it["source"] == "toy"]

    def toy_accuracy(texts):
        if not toy_items:
            return None
        examples = [toy_examples[items[i]["id"]] for i in toy_items]
        verdicts = toy.score_many(examples, [texts[i] for i in toy_items])
        return sum(verdicts) / len(verdicts)

    if "original" not in done:
        from ..data.distilled import read_answers

        answers = read_answers(out / "distill" / "heldout.jsonl")
        done["original"] = {
            "toy_accuracy": toy_accuracy([answers[it["id"]]["messages"][-1]["content"] for it in items])
        }
        store.save()
    model = tokenizer = None
    for tau in preset.taus:
        key = f"tau={tau:g}"
        if key in done:
            continue
        if model is None:
            taus = ", ".join(map(str, preset.taus))
            stages.stage(4, f"evaluating {mars} on {len(items)} held-out prompts at tau {taus}")
            model, tokenizer, _ = load_model(str(mars), dtype="float32", device=resolve_device("auto"))
        started = time.perf_counter()
        block_size = checkpoint_facts(model, tokenizer).block_size
        result = decode_heldout(model, tokenizer, items, tau, preset.max_new_tokens, block_size, preset.eval_batch)
        result["toy_accuracy"] = toy_accuracy(result["texts"])
        result["seconds"] = round(time.perf_counter() - started, 1)
        done[key] = result
        store.save()
        stages.say(
            f"    tau {tau:g}: {result['tokens_per_forward']:.2f} tokens per forward, "
            f"{100 * result['exact_match']:.0f}% equal to the original's greedy answer"
        )
    return done


PROBE_BATCH = 8  # items per forward: the kept logits grow with the vocabulary (49k rows here)


def probe_stage(
    stages: Stages, mars: Path, original: Path, out: Path, preset: RealModelPreset, items: list[dict], progress: bool
):
    """The probe on every held-out answer, MARS in float32, and the original's bf16 baseline -> OUT/probe.json."""
    import torch

    from ..chat import stop_token_ids
    from ..data.distilled import read_answers
    from ..eval.probe import probe, probe_clean
    from ..eval.probe_items import probe_item
    from ..files import read_json, write_json_atomically
    from ..modeling import checkpoint_facts, load_model, resolve_device

    path = out / "probe.json"
    if path.is_file():
        stages.stage(5, f"probe: {path} is there")
        return read_json(path)
    stages.stage(5, f"probing {mars} on {len(items)} held-out answers (teacher-forced), and the original in bf16")
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
    stages.say(
        f"    fidelity {100 * report['fidelity']['top1_agreement']:.1f}% (the original in bf16: "
        f"{100 * report['original_bf16']['fidelity']['top1_agreement']:.1f}%), tokens per forward teacher-forced "
        + ", ".join(f"tau {t}: {v:.2f}" for t, v in report["tokens_per_forward_paper_tf"].items())
    )
    return report


BENCH_DTYPES = ("float32", "bfloat16")


def bench_stage(stages: Stages, mars: Path, original: Path, out: Path, preset: RealModelPreset, progress: bool) -> dict:
    """Decoding speed on held-out prompts of the training distribution (the first of the distilled
    held-out answers, scored as agreement with them): lossless and tau 0.95 against HF ``generate`` on the
    original, in float32 and bfloat16, at batch 1 and 8, each dtype's contenders interleaved
    (bench/speed.py) -> OUT/bench.json. Each finished dtype is kept."""
    from ..bench.config import BenchConfig
    from ..bench.speed import run_bench
    from ..eval.sets import load_eval_set
    from ..modeling import load_model, resolve_device

    store = JsonStore(out / "bench.json", {})
    done = store.value
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
    eval_set = load_eval_set(f"answers:{out / 'distill' / 'heldout.jsonl'}", config.n)
    for dtype in BENCH_DTYPES:
        if dtype in done:
            continue
        stages.stage(6, f"decoding speed in {dtype}: lossless and tau 0.95 against HF generate on the original")
        models = {
            name: load_model(str(path_), dtype=dtype, device=resolve_device("auto"))[:2]
            for name, path_ in (("mars", mars), ("ar", original))
        }
        done[dtype] = run_bench(models, eval_set, config)
        store.save()
    return done


def format_report(report: dict) -> str:
    from ..eval.probe_report import format_probe

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
    lines += _family_table(report["mars"])
    if report.get("probe"):
        lines += [
            "",
            "probe (teacher-forced on the original's answers, marslm probe): " + format_probe(report["probe"]),
        ]
    for dtype, bench in (report.get("bench") or {}).items():
        from ..bench.report import format_bench_table

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


def _family_table(results: dict) -> list[str]:
    """Tokens per forward (decoded, as above) per prompt family, one column per tau."""
    results = [r for r in results.values() if "by_family" in r]
    if not results:
        return []
    names = sorted({f for r in results for f in r["by_family"]})
    head = "| family | prompts | " + " | ".join(f"tau {r['tau']:g}" for r in results) + " |"
    lines = ["", f"tokens per forward by prompt family ({DECODED_LABEL}):", head, "|---|---|" + "---|" * len(results)]
    for name in names:
        n = next(r["by_family"][name]["n"] for r in results if name in r["by_family"])
        cells = [
            f"{r['by_family'][name]['tokens_per_forward']:.2f}" if name in r["by_family"] else "-" for r in results
        ]
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return lines
