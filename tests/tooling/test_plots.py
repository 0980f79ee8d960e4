"""``marslm plot``: which reports it reads, the baseline rule, the frontier, bad input.

Reports are written by hand here (the shapes evaluate/sweep/demo write), so no model is needed.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from marslm import cli
from marslm.errors import UserError
from marslm.eval.plots import load_series, pareto_front, plot_frontier

FAMILIES = ("arithmetic", "code", "format", "lists")


def cell(tau, accuracy, tpf, metric="prob", block_size=4, **extra):
    return {
        "tau": tau,
        "metric": metric,
        "block_size": block_size,
        "cache": "cursor",
        "mode": "threshold",
        "accuracy": accuracy,
        "n": 40,
        "tokens_per_forward": tpf,
        "forwards_per_answer": 50 / tpf,
        "tokens_per_second": 10.0,
        "seconds": 1.0,
        "families": {
            f: {"accuracy": accuracy - 0.05 * i, "n": 10, "tokens_per_forward": tpf + 0.1 * i}
            for i, f in enumerate(FAMILIES)
        },
        **extra,
    }


def model_report(model, cells, **extra):
    return {"model": model, "data": "toy", "data_n": 40, "data_seed": 0, **extra, "results": cells}


AR = model_report("runs/x/ar", [cell(1.0, 0.8, 1.0, block_size=1)], stage="ar")
MARS = model_report(
    "runs/x/mars",
    [
        cell(1.0, 0.82, 1.0),
        cell(0.95, 0.8, 1.5),
        cell(0.9, 0.7, 1.4),
        cell(0.7, 0.6, 2.1),
        cell(0.0, 0.82, 1.0, metric="entropy"),
        cell(0.5, 0.75, 1.8, metric="entropy"),
        {
            "tau": 0.3,
            "metric": "prob",
            "block_size": 4,
            "cache": "cursor",
            "mode": "threshold",
            "failed": "RuntimeError: out of memory",
        },
    ],
    stage="mars",
)


def write(tmp_path, name, payload):
    path = tmp_path / name
    path.write_text(json.dumps(payload))
    return str(path)


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def test_pareto_front():
    points = [(1.0, 80), (1.5, 80), (1.4, 70), (2.1, 60), (1.2, 75)]
    assert pareto_front(points) == [(1.5, 80), (2.1, 60)]


def test_reads_sweep_eval_and_demo_reports(tmp_path):
    sweep = load_series([write(tmp_path, "sweep.json", {"models": [AR, MARS]})])
    assert [(s.label, s.baseline, len(s.cells)) for s in sweep] == [("ar", True, 1), ("mars", False, 6)]

    single = load_series([write(tmp_path, "eval.json", MARS)])
    assert [(s.label, s.baseline) for s in single] == [("mars", False)]

    # The demo's report.json: named eval reports beside other data; "ar" has only tau=1 results.
    demo = {
        "ar": {k: v for k, v in AR.items() if k != "stage"},
        "mars": MARS,
        "ar_learning_curve": [],
        "preset": {"model": "default"},
        "seconds": {"total": 1},
    }
    assert [(s.label, s.baseline) for s in load_series([write(tmp_path, "report.json", demo)])] == [
        ("ar", True),
        ("mars", False),
    ]


def test_baseline_option(tmp_path):
    both = write(tmp_path, "sweep.json", {"models": [AR, MARS]})
    ar_file = write(tmp_path, "ar.json", AR)
    mars_file = write(tmp_path, "mars.json", MARS)
    by_label = load_series([both], baseline=["mars"])
    assert [(s.label, s.baseline) for s in by_label] == [("ar", False), ("mars", True)]
    by_file = load_series([mars_file], baseline=[ar_file])
    assert [s.baseline for s in by_file] == [False, True]
    with pytest.raises(UserError, match="no such report file or model label"):
        load_series([both], baseline=["nope"])
    no_one_token = model_report("m", [cell(0.9, 0.7, 1.4)])
    with pytest.raises(UserError, match="no one-token"):
        load_series([write(tmp_path, "m.json", no_one_token)], baseline=["m"])


def test_plot_writes_a_legible_png(tmp_path):
    from PIL import Image

    out = plot_frontier(load_series([write(tmp_path, "sweep.json", {"models": [AR, MARS]})]), tmp_path / "f.png")
    image = Image.open(out).convert("RGB")
    width, height = image.size
    assert width > 1200 and height > 600  # 3 x 2 panels: overall + 4 families
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # lines, markers, text: not a blank canvas


def test_plot_cli_and_bad_input(tmp_path):
    good = write(tmp_path, "sweep.json", {"models": [AR, MARS]})
    rc, out, _ = run_cli("plot", good, "--out", tmp_path / "plot.png")
    assert rc == 0 and (tmp_path / "plot.png").stat().st_size > 10_000 and "wrote" in out

    (tmp_path / "broken.json").write_text("{oops")
    cases = [
        (tmp_path / "missing.json", "report not found"),
        (tmp_path / "broken.json", "broken.json:1: malformed JSON"),
        (write(tmp_path, "other.json", {"hello": 1}), "not a marslm report"),
        (write(tmp_path, "bad_results.json", {"model": "m", "results": "nope"}), "lacks a 'results' list"),
        (write(tmp_path, "no_numbers.json", {"model": "m", "results": [{"tau": 1.0}]}), "lacks tau, accuracy"),
        (write(tmp_path, "all_failed.json", model_report("m", [{"tau": 1.0, "failed": "x"}])), "no successful results"),
    ]
    for path, message in cases:
        rc, _, err = run_cli("plot", path, "--out", tmp_path / "x.png")
        assert rc == 2 and message in err and err.count("\n") == 1, (path, err)


def test_plot_says_the_file_it_wrote(tmp_path):
    good = write(tmp_path, "sweep.json", {"models": [AR, MARS]})
    figures = tmp_path / "figures"
    figures.mkdir()
    for out, written in ((figures, figures / "frontier.png"), (tmp_path / "frontier-v2", tmp_path / "frontier-v2.png")):
        rc, printed, _ = run_cli("plot", good, "--out", out)
        assert rc == 0 and printed == f"wrote {written}\n" and written.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures", "frontier-v2.png", "sweep.json"]
