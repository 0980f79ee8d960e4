"""``marslm bench``'s report for people: the speed targets checked on a report, and its tables
(decoding speed; with ``--cost-curve``, forward time against fed width). The runs are bench.py's.
"""

from __future__ import annotations

HF_COMPILED = "HF generate static+compile (AR ckpt)"  # bench --compile: HF generate's own compiled decoding
PAPER_REFERENCE = (
    "paper (Qwen2.5-7B, GPU, block cache, tau 0.95): 1.71x at batch 4, 1.60x at 8, 1.34x at 16; "
    "without a cache 0.90x / 0.49x / 0.23x"
)

# The project's speed targets on this benchmark: (data, contender, batch size, least speed-up over
# HF generate on the AR checkpoint), the contenders decoding with the default settings (the cursor
# and lossless groups without --adaptive-width or --mask-batch-limit). Off the training
# distribution MARS must not be slower than AR.
TARGETS = (
    ("toy", "MARS cursor tau=0.95", 1, 1.6),
    ("toy", "MARS cursor tau=0.95", 8, 1.4),
    ("toy", "MARS lossless", 1, 1.5),
    ("reworded", "MARS cursor tau=0.95", 1, 0.95),
    ("reworded", "MARS cursor tau=0.95", 8, 0.95),
)


def check_targets(report: dict) -> list[str]:
    """One line per target that this report's data has: met or missed, and by how much."""
    rows = {(r["contender"], r["batch_size"]): r for r in report["rows"] if "speedup" in r}
    lines = []
    for data, name, batch, want in TARGETS:
        row = rows.get((name, batch))
        if row is not None and report.get("data") == data:
            got = row["speedup"]
            verdict = "met" if got >= want else f"MISSED by {want - got:.2f}x"
            lines.append(f"{name} at batch {batch} ({data}): {got:.2f}x vs target {want:.2f}x -- {verdict}")
    lookup = rows.get(("HF prompt lookup (MARS ckpt)", 1))
    mars = rows.get(("MARS cursor tau=0.95", 1))
    if lookup and mars:
        verdict = "met" if mars["speedup"] > lookup["speedup"] else "MISSED"
        lines.append(
            f"MARS tau=0.95 vs HF prompt lookup at batch 1: {mars['speedup']:.2f}x vs "
            f"{lookup['speedup']:.2f}x -- {verdict}"
        )
    return lines


def format_bench_table(report: dict) -> str:
    head = ["contender", "batch", "tok/s (median, min-max)", "tok/fwd", "vs AR", "accuracy", "= greedy", "peak KV MiB"]
    drafted = any("drafter_forwards" in r for r in report["rows"])
    head += ["drafter fwd"] if drafted else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        cells = [r["contender"], str(r["batch_size"])]
        if "refused" in r:
            cells.append(f"refused: {r['refused']}")
        else:
            cells += _measured(r) + ([str(r.get("drafter_forwards", "-"))] if drafted else [])
        lines.append("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")
    lines.append("")
    lines += [f"- {line}" for line in check_targets(report)]
    lines.append("")
    if drafted:
        lines.append(
            f"Drafter {report.get('draft_model')}: tok/fwd counts the target's forwards; drafter fwd, the "
            "drafter's over one pass; both models' time is in tok/s."
        )
    compiled = [
        r
        for r in report["rows"]
        if "speedup_vs_hf_compiled" in r and r["options"].get("compile") and r["contender"] != HF_COMPILED
    ]
    if compiled:
        lines.append(
            "Against HF generate compiled (its static cache, torch.compile of its step): "
            + ", ".join(
                f"{r['contender']} at batch {r['batch_size']}: {r['speedup_vs_hf_compiled']:.2f}x" for r in compiled
            )
            + "."
        )
    lines.append(
        f"n={report['n']} prompts, {report['repeats']} repeats, max {report['max_new_tokens']} new tokens, "
        f"device {report['device']}, {report.get('dtype', 'float32')}, {report['threads']} threads. "
        f"Reference: {report['paper_reference']}"
    )
    return "\n".join(lines)


def _measured(r: dict) -> list[str]:
    """A measured row's cells from tok/s to peak KV."""
    return [
        f"{r['tokens_per_second']:.0f} ({r['tokens_per_second_min']:.0f}-{r['tokens_per_second_max']:.0f})",
        f"{r['tokens_per_forward']:.2f}",
        f"{r.get('speedup', float('nan')):.2f}x",
        f"{100 * r['accuracy']:.1f}",
        {True: "yes", False: "no"}.get(r.get("same_as_greedy"), "-"),
        f"{r['peak_kv_mib']:.2f}",
    ]


def format_cost_curve(report: dict) -> str:
    widths = report["widths"]
    head = ["batch", "context"] + [f"w={w}" for w in widths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(r["batch_size"], r["context"]) for r in report["rows"]})
    for batch, context in keys:
        cells = {r["width"]: r for r in report["rows"] if (r["batch_size"], r["context"]) == (batch, context)}
        lines.append(
            "| " + " | ".join([str(batch), str(context)] + [f"{cells[w]['ratio']:.2f}" for w in widths]) + " |"
        )
    base = {(r["batch_size"], r["context"]): r["ms"] for r in report["rows"] if r["width"] == widths[0]}
    lines.append("")
    lines.append(
        "Forward time as a ratio to feeding one token (w=1: "
        + ", ".join(f"batch {b} context {c}: {ms:.1f} ms" for (b, c), ms in sorted(base.items()))
        + f"); {report['repeats']} repeats, device {report['device']}, {report['threads']} threads"
        + (", the compiled step (static cache, one graph per width). " if report.get("compiled") else ". ")
        + "A MARS step at block size B feeds up to B + 1 columns (2B + 2 with draft groups): it pays when "
        "tokens per forward exceed the ratio at that width."
    )
    return "\n".join(lines)


def format_profile(report: dict) -> str:
    """A cost curve's profiles (``cost_curve(profile=...)``): per profiled width, where a forward's
    host time goes, costliest operator first."""
    step = "compiled" if report.get("compiled") else "eager"
    lines = []
    for width, profiled in report["profile"].items():
        lines.append(f"{step} step, width {width} (batch {profiled['batch_size']}, context {profiled['context']}):")
        lines += ["| operator | calls per forward | ms per forward | share |", "|---|---|---|---|"]
        lines += [f"| {op['op']} | {op['calls']:g} | {op['ms']:.3f} | {op['share']:.0%} |" for op in profiled["ops"]]
        lines.append("")
    lines.append("Self host time per operator (torch.profiler), the inputs' making included.")
    return "\n".join(lines)


def format_against_eager(eager: dict, compiled: dict) -> str:
    """The compiled step's time at each width as a ratio to the eager one-token step's, the same
    batch size and context: what a compiled MARS step costs against plain eager decoding."""
    widths = compiled["widths"]
    one = {(r["batch_size"], r["context"]): r["ms"] for r in eager["rows"] if r["width"] == eager["widths"][0]}
    head = ["batch", "context"] + [f"w={w}" for w in widths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (batch, context), base in sorted(one.items()):
        cells = {r["width"]: r["ms"] for r in compiled["rows"] if (r["batch_size"], r["context"]) == (batch, context)}
        lines.append("| " + " | ".join([str(batch), str(context)] + [f"{cells[w] / base:.2f}" for w in widths]) + " |")
    lines.append("")
    lines.append("The compiled step's time as a ratio to the eager step that feeds one token (HF generate's step).")
    return "\n".join(lines)
