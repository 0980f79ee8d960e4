"""What ``marslm probe`` reports by default and how its report reads (probe.py measures it).
Torch-free, so the CLI builds its parser without loading torch."""

from __future__ import annotations

DEFAULT_TAUS = (0.9, 0.95)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_probe(report: dict) -> str:
    """The report as text for people: a summary and the per-offset table."""
    fid = report["fidelity"]
    by_source = ", ".join(f"{s} {_pct(v['top1_agreement'])}" for s, v in fid["by_source"].items())
    baseline = report.get("original_bf16")
    lines = [
        f"{fid['items']} items, {fid['answer_tokens']} answer tokens"
        + (f", {report['blocks']} blocks of B={report['block_size']}" if "blocks" in report else "")
        + (f", {report['seconds']:.1f} s" if "seconds" in report else ""),
        f"fidelity (clean top-1 = reference): {_pct(fid['top1_agreement'])} ({by_source})"
        + (f"; original in bf16: {_pct(baseline['fidelity']['top1_agreement'])}" if baseline else ""),
        f"items whose every token agrees: {_pct(fid['items_all_agree'])}; mean agreeing prefix "
        f"{_num(fid['mean_agreeing_prefix'], 1)} tokens",
    ]
    if "offsets" not in report:  # a model without a mask token: fidelity is all there is
        return "\n".join(lines)
    lines += [
        "tokens per forward, teacher-forced, B candidates: "
        + ", ".join(f"paper rule tau {t}: {v:.2f}" for t, v in report["tokens_per_forward_paper_tf"].items() if v)
        + (
            f"; lossless (masks equal to the clean top-1): {report['tokens_per_forward_lossless_tf']:.2f}"
            if report["tokens_per_forward_lossless_tf"]
            else ""
        ),
        f"held-out cross-entropy (nats): clean {_num(report['clean_ce'])}, masks {_num(report['masked_ce'])}",
        "",
    ]
    taus = list(report["offsets"][0]["confident"])
    header = ["offset", "predicts", "n", "top-1 acc", "CE"]
    for tau in taus:
        header += [f"p>={tau}", f"acc if p>={tau}"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for o in report["offsets"]:
        cells = [str(o["offset"]), o["predicts"], str(o["n"]), _pct(o["top1_accuracy"])]
        cells.append(_num(o["ce"]))
        for tau in taus:
            c = o["confident"][tau]
            cells += [_pct(c["share"]), _pct(c["precision"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
