"""``marslm plot``: the accuracy / tokens-per-forward frontier, one panel per task family.

Reads any report marslm writes: an eval report (``{"model", "results"}``), a sweep report
(``{"models": [...]}``) or the demo's ``report.json`` (``{"ar": <eval report>, "mars": ...}``).

Each panel (``overall``, then one per family) has tokens per forward on x and accuracy on y.
Every (model, block size, metric) is one curve: its points are the taus, and the line joins
the Pareto-optimal ones (no other point of the curve is both faster and more accurate).

The AR SFT baseline is a dotted horizontal line at its accuracy. Which model is the baseline:
  * ``--baseline X``: X is a report file (all its models are baselines) or a model label;
  * otherwise: a checkpoint that the sweep recorded as stage "ar", or a model whose results are
    all one-token mode (tau = 1; entropy tau = 0), e.g. the demo's ``ar`` report.
A baseline with several one-token cells uses the first.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..files import output_file, read_json
from .evaluate import is_one_token, model_reports


@dataclass
class Series:
    """One model report with the label it is drawn under."""

    label: str
    report: dict
    baseline: bool = False
    cells: list = field(default_factory=list)  # successful cells only


def _read_report(path: str | Path) -> object:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"report not found: {path}")
    return read_json(path)


def reports_in(payload, source: str) -> list[tuple[str | None, dict]]:
    """``(label or None, model report)`` for every model report in a file's payload."""
    if isinstance(payload, dict) and ("results" in payload or "models" in payload):
        return [(None, rep) for rep in model_reports(payload, source)]
    if isinstance(payload, dict):  # the demo's report: named eval reports beside other data
        named = [(name, rep) for name, rep in payload.items() if isinstance(rep, dict) and "results" in rep]
        if named:
            for name, rep in named:
                model_reports(rep, f"{source} ({name})")  # validates the shape
            return named
    raise UserError(f"{source}: not a marslm report (no 'results', 'models', or named eval reports)")


def _short_labels(names: list[str]) -> list[str]:
    """Model paths without their common directory, so ``runs/x/ar`` and ``runs/x/mars`` read ``ar``, ``mars``."""
    if len(names) == 1:
        return [Path(names[0]).name or names[0]]
    common = os.path.commonpath(names) if all(n.startswith("/") == names[0].startswith("/") for n in names) else ""
    shortened = [os.path.relpath(n, common) if common else n for n in names]
    return [s if s not in ("", ".") else n for s, n in zip(shortened, names)]


def load_series(paths: list[str], baseline: list[str] | None = None) -> list[Series]:
    """Every model report of every file, labelled, with the baseline rule of the module docstring applied."""
    found: list[tuple[str | None, dict, bool]] = []
    for path in paths:
        found += [(label, rep, False) for label, rep in reports_in(_read_report(path), str(path))]
    baseline_labels = []
    for item in baseline or []:
        if Path(item).is_file():
            found += [(label, rep, True) for label, rep in reports_in(_read_report(item), item)]
        else:
            baseline_labels.append(item)

    unnamed = [str(rep.get("model", "") or "model") for label, rep, _ in found if label is None]
    short = iter(_short_labels(unnamed)) if unnamed else iter(())
    series = []
    for label, rep, forced in found:
        label = label if label is not None else next(short)
        cells = [c for c in rep["results"] if "failed" not in c]
        for c in cells:
            _check_cell(c, label)
        series.append(Series(label, rep, forced, cells))
    labels = [s.label for s in series]
    for s in series:  # the same model on other data (or n, seed): say which
        if labels.count(s.label) > 1:
            s.label += f" ({s.report.get('data')}, n={s.report.get('data_n')}, seed={s.report.get('data_seed')})"

    for name in baseline_labels:
        matches = [s for s in series if name in (s.label, s.report.get("model"))]
        if not matches:
            raise UserError(
                f"--baseline {name}: no such report file or model label (labels: {', '.join(s.label for s in series)})"
            )
        for s in matches:
            s.baseline = True
    if not baseline:  # no --baseline: the rule of the module docstring
        for s in series:
            s.baseline = (
                s.baseline or s.report.get("stage") == "ar" or (bool(s.cells) and all(is_one_token(c) for c in s.cells))
            )
    for s in series:
        if s.baseline and not any(is_one_token(c) for c in s.cells):
            raise UserError(f"baseline {s.label} has no one-token (tau=1) result to draw")
    if not any(s.cells for s in series):
        raise UserError("the reports hold no successful results to plot")
    return series


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_cell(cell: dict, label: str) -> None:
    """A result the plot can draw: tau, accuracy and tokens per forward are numbers, and so are
    each family's."""
    keys = ("tau", "accuracy", "tokens_per_forward")
    if not all(k in cell for k in keys):
        raise UserError(f"report for {label}: a result lacks tau, accuracy or tokens_per_forward")
    bad = next((k for k in keys if not _is_number(cell[k])), None)
    if bad is not None:
        raise UserError(f"report for {label}: a result's {bad} must be a number, got {cell[bad]!r}")
    for key in ("metric", "mode"):  # labels: a baseline may name its own (the Jacobi decoder's)
        if key in cell and not isinstance(cell[key], str):
            raise UserError(f"report for {label}: a result's {key} must be a string, got {cell[key]!r}")
    families = cell.get("families", {})
    if not isinstance(families, dict) or not all(
        isinstance(f, dict) and all(_is_number(f.get(k)) for k in keys[1:]) for f in families.values()
    ):
        raise UserError(
            f"report for {label}: a result's families must map each family to its accuracy and tokens_per_forward"
        )


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (higher is better on both), by increasing x."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


def _panel_values(cell: dict, panel: str) -> tuple[float, float] | None:
    """(tokens per forward, accuracy in %) of a cell in a panel; None when the family is absent."""
    if panel == "overall":
        return cell["tokens_per_forward"], 100 * cell["accuracy"]
    fam = cell.get("families", {}).get(panel)
    if fam is None:
        return None
    return fam["tokens_per_forward"], 100 * fam["accuracy"]


def _curves(series: list[Series]) -> list[tuple[str, list[dict]]]:
    """``(curve label, cells ordered by tau)`` per (model, block size, metric, mode) of the non-baselines."""
    models = [s for s in series if not s.baseline]
    curves = []
    for s in models:
        groups: dict[tuple, list[dict]] = {}
        for c in s.cells:
            groups.setdefault((c.get("block_size"), c.get("metric", "prob"), c.get("mode", "threshold")), []).append(c)
        for (block, metric, mode), cells in groups.items():
            name = f"B={block} {metric}" + (f" {mode}" if mode != "threshold" else "")
            label = f"{s.label}: {name}" if len(models) > 1 else f"{s.label} {name}"
            curves.append((label, cells))
    return curves


def _widen(ax, axis: str, min_span: float, lowest: float | None, highest: float | None) -> None:
    """Stretch a nearly flat axis to ``min_span`` around its centre, kept within [lowest, highest]."""
    low, high = ax.get_ylim() if axis == "y" else ax.get_xlim()
    if high - low >= min_span:
        return
    centre = (low + high) / 2
    low, high = centre - min_span / 2, centre + min_span / 2
    if lowest is not None and low < lowest:
        low, high = lowest, max(high, lowest + min_span)
    if highest is not None and high > highest:
        low, high = min(low, highest - min_span), highest
    (ax.set_ylim if axis == "y" else ax.set_xlim)(low, high)


IMAGE_NAME = "frontier.png"


def image_path(out: str | Path) -> Path:
    """The file :func:`plot_frontier` writes for ``out``: ``out`` itself, with ``.png`` added when it
    has no suffix (as matplotlib would), or ``IMAGE_NAME`` inside it when it is a directory."""
    out = Path(out)
    if out.is_dir():
        out = out / IMAGE_NAME
    elif not out.suffix:
        out = out.with_name(out.name + ".png")
    return output_file(out, "--out")


def plot_frontier(series: list[Series], out: str | Path, title: str | None = None) -> Path:
    """Draw the panels to :func:`image_path` of ``out`` (PNG, or any format matplotlib infers from
    the suffix); returns that path."""
    out = image_path(out)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("marslm plot needs matplotlib: pip install 'marslm[plot]'") from None

    families = sorted({f for s in series for c in s.cells for f in c.get("families", {})})
    panels = ["overall", *families]
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    spare = nrows * ncols - len(panels)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows + (0 if spare else 1.0)), squeeze=False)
    curves = _curves(series)
    baselines = [s for s in series if s.baseline]
    for ax, panel in zip(axes.flat, panels):
        _draw_panel(ax, panel, curves, baselines, plt.get_cmap("tab10"))
    _legend(fig, axes, len(panels), spare)
    data = sorted(
        {
            f"{s.report.get('data', '?')}" + (f" (n={s.report['data_n']})" if s.report.get("data_n") else "")
            for s in series
        }
    )
    fig.suptitle(title or f"Accuracy vs tokens per forward: {', '.join(data)}", fontsize=13)
    fig.tight_layout(rect=(0, 0 if spare else 0.08, 1, 0.96))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot write {out}: {exc}") from None
    finally:
        plt.close(fig)
    return out


MARKERS = "osD^vP*X"


def _draw_panel(ax, panel: str, curves, baselines: list[Series], colours) -> None:
    """One panel: each curve's points and Pareto front, and each baseline's one-token accuracy."""
    for i, (label, cells) in enumerate(curves):
        pts = [(v, c) for c in cells if (v := _panel_values(c, panel)) is not None]
        if not pts:
            continue
        colour, marker = colours(i % 10), MARKERS[i % len(MARKERS)]
        ax.scatter(
            [v[0] for v, _ in pts], [v[1] for v, _ in pts], color=colour, marker=marker, alpha=0.45, s=28, zorder=3
        )
        front = pareto_front([v for v, _ in pts])
        ax.plot(
            [p[0] for p in front],
            [p[1] for p in front],
            color=colour,
            marker=marker,
            linewidth=1.8,
            markersize=6,
            label=label,
            zorder=4,
        )
        if panel == "overall":  # taus that land on the same point share one label
            at: dict[tuple, list[str]] = {}
            for v, c in pts:
                at.setdefault((round(v[0], 3), round(v[1], 2)), []).append(f"{c['tau']:g}")
            for v, taus in at.items():
                ax.annotate(",".join(taus), v, textcoords="offset points", xytext=(4, 4), fontsize=7, color=colour)
    for j, s in enumerate(baselines):
        one_token = next(c for c in s.cells if is_one_token(c))
        value = _panel_values(one_token, panel)
        if value is not None:
            ax.axhline(
                value[1],
                color=("black", "dimgray", "gray")[j % 3],
                linestyle=":",
                linewidth=1.8,
                label=f"AR SFT baseline: {s.label}",
                zorder=2,
            )
    ax.set_title(panel, fontsize=12, fontweight="bold" if panel == "overall" else "normal")
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("accuracy (%)")
    ax.grid(True, alpha=0.3)
    _widen(ax, axis="y", min_span=10, lowest=-2, highest=102)  # no magnified noise, no 0.01% grid
    _widen(ax, axis="x", min_span=0.5, lowest=0.9, highest=None)


def _legend(fig, axes, n_panels: int, spare: int) -> None:
    """In the first spare panel when the grid has one, else under the figure."""
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if spare:
        for ax in list(axes.flat)[n_panels:]:
            ax.axis("off")
        list(axes.flat)[n_panels].legend(
            handles, labels, loc="center", fontsize=9, frameon=False, title="(overall panel: tau beside each point)"
        )
    else:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=9, frameon=False)
