"""Sweeps: the settings grid, resuming from the JSON file, failed cells, the CLI around them.

Decoding runs on the toy-trained tiny checkpoint pair (tests/trained.py) with a handful of test
items and short answers: what is checked is the bookkeeping, not accuracy.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import marslm.decode.generation as generation
from marslm import cli
from marslm.eval.evaluate import EvalConfig, is_one_token, model_reports, plan_cells
from marslm.eval.evaluate import sweep as sweep_config
from marslm.eval.report import format_table

SMALL = dict(n=6, seed=0, batch_size=6, max_new_tokens=24, progress=False)


def sweep(models, data, **settings) -> dict:
    return sweep_config(EvalConfig(models, data, **settings))


def run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts calls of the decoder behind evaluate(), recording each call's settings."""
    calls = []
    real = generation.generate

    def counting(model, tokenizer, prompts, params, *args, **kwargs):
        calls.append({k: getattr(params, k) for k in ("tau", "metric", "block_size")})
        return real(model, tokenizer, prompts, params, *args, **kwargs)

    monkeypatch.setattr(generation, "generate", counting)
    return calls


def test_plan_cells():
    common = dict(taus=[1.0, 0.9], entropy_taus=[0.0, 0.5], metrics=["prob", "entropy"], cache="cursor")
    ar = plan_cells("ar", 1, block_sizes=[2, 4], mode="threshold", **common)
    assert [(c["tau"], c["block_size"]) for c in ar] == [(1.0, 1)]
    mars = plan_cells("mars", 4, block_sizes=None, mode="threshold", **common)
    assert [(c["block_size"], c["metric"], c["tau"]) for c in mars] == [
        (4, "prob", 1.0),
        (4, "prob", 0.9),
        (4, "entropy", 0.0),
        (4, "entropy", 0.5),
    ]
    assert [is_one_token(c) for c in mars] == [True, False, True, False]
    lossless = plan_cells("mars", 4, block_sizes=[2, 4], mode="lossless", **common)
    assert [(c["block_size"], c["mode"]) for c in lossless] == [(2, "lossless"), (4, "lossless")]


def test_sweep_grid_resume_and_shape(trained_dirs, tmp_path, decode_calls):
    ar, mars = str(trained_dirs["dir"] / "ar"), str(trained_dirs["dir"] / "mars")
    path = tmp_path / "sweep.json"
    grid = dict(taus=[1.0, 0.9], entropy_taus=[0.0, 0.5], metrics=["prob", "entropy"], block_sizes=[2, 4])
    payload = sweep([ar, mars], "toy", json_path=path, **grid, **SMALL)

    assert json.loads(path.read_text()) == payload
    ar_report, mars_report = payload["models"]
    assert ar_report["stage"] == "ar" and [c["tau"] for c in ar_report["results"]] == [1.0]
    assert mars_report["stage"] == "mars" and len(mars_report["results"]) == 8
    for cell in ar_report["results"] + mars_report["results"]:
        assert {
            "accuracy",
            "n",
            "tokens_per_forward",
            "forwards_per_answer",
            "tokens_per_second",
            "seconds",
            "families",
            "tau",
            "metric",
            "block_size",
            "cache",
            "mode",
        } <= set(cell)
        assert cell["n"] == 6 and "failed" not in cell
    # One-token cells (prob tau=1, entropy tau=0) are decoded once per model and shared.
    one_token = [c for c in mars_report["results"] if is_one_token(c)]
    assert len(one_token) == 4 and sum("shared_with" in c for c in one_token) == 3
    assert len({json.dumps(c["families"], sort_keys=True) for c in one_token}) == 1
    assert len(decode_calls) == 1 + 1 + 4  # AR, MARS one-token, MARS 4 others

    # The same sweep again decodes nothing.
    decode_calls.clear()
    again = sweep([ar, mars], "toy", json_path=path, **grid, **SMALL)
    assert decode_calls == []
    assert again["models"][1]["results"] == mars_report["results"]

    # A lost cell is the only one redone; a new tau adds one cell per metric using it.
    saved = json.loads(path.read_text())
    saved["models"][1]["results"] = [
        c
        for c in saved["models"][1]["results"]
        if not (c["block_size"] == 4 and c["metric"] == "prob" and c["tau"] == 0.9)
    ]
    path.write_text(json.dumps(saved))
    sweep([ar, mars], "toy", json_path=path, **grid, **SMALL)
    assert decode_calls == [{"tau": 0.9, "metric": "prob", "block_size": 4}]

    # Another data size is another cell key: the earlier cells stay, in their own model reports.
    decode_calls.clear()
    small = sweep([mars], "toy", json_path=path, **{**SMALL, "n": 3}, taus=[0.9], metrics=["prob"], block_sizes=[4])
    assert len(decode_calls) == 1
    assert [(r["model"], r["data_n"]) for r in small["models"]] == [(ar, 6), (mars, 6), (mars, 3)]


def test_failed_cell_is_recorded_and_retried(trained_dirs, tmp_path, monkeypatch, decode_calls):
    mars = str(trained_dirs["dir"] / "mars")
    path = tmp_path / "sweep.json"
    real = generation.generate  # the counting decoder of `decode_calls`

    def out_of_memory_at_low_tau(model, tokenizer, prompts, params, *args, **kwargs):
        if params.tau == 0.5:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")
        return real(model, tokenizer, prompts, params, *args, **kwargs)

    monkeypatch.setattr(generation, "generate", out_of_memory_at_low_tau)
    grid = dict(taus=[1.0, 0.5, 0.9], metrics=["prob"], block_sizes=[4])
    payload = sweep([mars], "toy", json_path=path, **grid, **SMALL)
    cells = payload["results"]  # one model: the plain eval-report shape
    assert payload["model"] == mars and [c["tau"] for c in cells] == [1.0, 0.5, 0.9]
    assert cells[1]["failed"] == "RuntimeError: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert "accuracy" not in cells[1] and "accuracy" in cells[2]  # the sweep went on
    assert "failed: RuntimeError" in format_table({"mars": payload})

    monkeypatch.setattr(generation, "generate", real)  # the memory is back: a rerun retries the cell
    decode_calls.clear()
    retried = sweep([mars], "toy", json_path=path, **grid, **SMALL)
    assert [c["tau"] for c in decode_calls] == [0.5]
    assert all("failed" not in c for c in retried["results"])


def test_eval_cli_single_model_shape_and_markdown(trained_dirs, tmp_path):
    mars = trained_dirs["dir"] / "mars"
    rc, out, _ = run_cli(
        "eval",
        "--model",
        mars,
        "--n",
        4,
        "--tau",
        "1,0.9",
        "--max-new-tokens",
        16,
        "--json",
        tmp_path / "r.json",
        "--markdown",
        tmp_path / "r.md",
        "--quiet",
    )
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model"] == str(mars) and report["data"] == "toy" and len(report["results"]) == 2
    assert "| model | tau | accuracy |" in out
    markdown = (tmp_path / "r.md").read_text()
    assert markdown.startswith("# marslm evaluation") and "| model | tau | accuracy |" in markdown
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temp files


def test_eval_cli_several_models_and_metrics(trained_dirs, tmp_path):
    root = trained_dirs["dir"]
    rc, out, _ = run_cli(
        "eval",
        "--model",
        f"{root / 'ar'},{root / 'mars'}",
        "--n",
        3,
        "--tau",
        "1,0.9",
        "--metric",
        "prob,margin,entropy",
        "--entropy-tau",
        "0,0.5",
        "--block-size",
        "3",
        "--max-new-tokens",
        12,
        "--json",
        tmp_path / "r.json",
        "--quiet",
    )
    assert rc == 0
    reports = model_reports(json.loads((tmp_path / "r.json").read_text()))
    assert [len(r["results"]) for r in reports] == [1, 6]
    assert {(c["metric"], c["tau"]) for c in reports[1]["results"]} == {
        ("prob", 1.0),
        ("prob", 0.9),
        ("margin", 1.0),
        ("margin", 0.9),
        ("entropy", 0.0),
        ("entropy", 0.5),
    }
    assert "| model | B | metric | tau |" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "model not found: /no/such/model"),
        (["--metric", "prob,vibes"], "unknown metric 'vibes'"),
        (["--tau", "1.5"], "tau for the prob metric must be in (0, 1]"),
        (["--entropy-tau", "-1", "--metric", "entropy"], "must be >= 0"),
        (["--data", "gsm8k:/no/such.jsonl"], "data file not found"),
    ],
)
def test_eval_cli_bad_input(trained_dirs, args, message):
    if "--model" not in args:
        args = ["--model", trained_dirs["dir"] / "mars", *args]
    rc, _, err = run_cli("eval", "--n", 2, "--quiet", *args)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_eval_cli_malformed_resume_file(trained_dirs, tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    rc, _, err = run_cli("eval", "--model", trained_dirs["dir"] / "mars", "--n", 2, "--json", bad, "--quiet")
    assert rc == 2 and "cannot resume from" in err and err.count("\n") == 1
    bad.write_text(json.dumps({"something": "else"}))
    rc, _, err = run_cli("eval", "--model", trained_dirs["dir"] / "mars", "--n", 2, "--json", bad, "--quiet")
    assert rc == 2 and "not a marslm eval report" in err


def test_paired_bootstrap_interval():
    from marslm.eval.report import paired_bootstrap

    assert paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1]) == (0.0, 0.0)
    assert paired_bootstrap([1] * 50, [0] * 50) == (100.0, 100.0)
    # 500 items, 80% vs 78% with independent errors: an interval of a few points around +2
    import random

    rng = random.Random(3)
    a = [int(rng.random() < 0.80) for _ in range(500)]
    b = [int(rng.random() < 0.78) for _ in range(500)]
    low, high = paired_bootstrap(a, b, seed=1)
    diff = 100 * (sum(a) - sum(b)) / 500
    assert low < diff < high
    assert 7.0 < high - low < 13.0  # 1.96 x 2 x sqrt((.16 + .17) / 500) = 10 points
    assert paired_bootstrap(a, b, seed=1) == (low, high)  # seeded
    with pytest.raises(ValueError):
        paired_bootstrap([1], [1, 0])


def test_a_sweep_in_another_dtype_is_its_own_cells(trained_dirs, tmp_path, monkeypatch):
    """``--dtype`` loads the model in that dtype, and its cells say so: a sweep resumed in the saved
    dtype decodes them again rather than reusing them, and the other way round."""
    import marslm.modeling as modeling

    mars = str(trained_dirs["dir"] / "mars")
    path = tmp_path / "sweep.json"
    loaded = []
    real = modeling.load_model

    def recorded(name, dtype="auto", **kwargs):
        out = real(name, dtype=dtype, **kwargs)
        loaded.append(str(next(out[0].parameters()).dtype))
        return out

    monkeypatch.setattr(modeling, "load_model", recorded)
    grid = dict(taus=[1.0], json_path=path, **SMALL)
    bf16 = sweep([mars], "toy", dtype="bfloat16", **grid)
    assert loaded == ["torch.bfloat16"] and [c.get("dtype") for c in bf16["results"]] == ["bfloat16"]
    # each cell names what it decoded with, beyond its settings
    assert {k: bf16["results"][0][k] for k in ("decoded_dtype", "compiled", "cost_table")} == {
        "decoded_dtype": "bfloat16",
        "compiled": False,  # the suite runs with MARSLM_COMPILE=off
        "cost_table": None,  # and MARSLM_COSTS=off: no table beside this checkpoint
    }
    saved = sweep([mars], "toy", **grid)
    assert loaded[1:] == ["torch.float32"]
    assert sorted(str(c.get("dtype")) for c in saved["results"]) == ["None", "bfloat16"]
    with pytest.raises(SystemExit) as refused, contextlib.redirect_stderr(io.StringIO()):
        run_cli("eval", "--model", mars, "--dtype", "float16x")
    assert refused.value.code == 2
