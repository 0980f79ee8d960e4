"""The main job end to end, at the quick preset: every stage runs and the report is well formed."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from marslm.cli import main
from marslm.demo.smollm2_presets import SMOLLM2_PRESETS, resolve_preset
from marslm.errors import UserError
from marslm.mars_json import MarsConfig


@pytest.mark.slow
def test_quick_demo_writes_a_well_formed_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--preset", "quick", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| MARS B=4 | 0.95 |" in printed

    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"ar", "ar_control", "mars", "ar_learning_curve", "preset", "seconds"}
    assert [r["tau"] for r in report["ar"]["results"]] == [1.0]
    assert [r["tau"] for r in report["ar_control"]["results"]] == [1.0]
    assert [r["tau"] for r in report["mars"]["results"]] == [1.0, 0.95, 0.9]
    paper = report["mars_paper_sampler"]["results"]
    assert [r["tau"] for r in paper] == [0.95, 0.9]
    assert not any(r["use_last_mask"] or r["adaptive_width"] for r in paper)
    assert "| MARS B=4, the paper's sampler (B candidates) | 0.95 |" in printed
    for result in report["ar"]["results"] + report["ar_control"]["results"] + report["mars"]["results"]:
        assert 0.0 <= result["accuracy"] <= 1.0
        assert result["tokens_per_forward"] >= 1.0
        assert set(result["families"]) == {"arithmetic", "format", "lists", "code"}
        assert sum(f["n"] for f in result["families"].values()) == result["n"]
    # one-token mode is AR decoding: exactly one token per forward
    assert report["mars"]["results"][0]["tokens_per_forward"] == 1.0
    assert [point["step"] for point in report["ar_learning_curve"]] == [30, 60]
    # the results, checked on this run (the quick preset makes no quality claims, so only the shape)
    assert [c["result"] for c in report["checks"]] == [0, 1, 1, 2, 3]
    assert [c["met"] is None for c in report["checks"]] == [False, False, True, False, True]
    assert "control" in report["checks"][1]["claim"] and "parent" in report["checks"][2]["claim"]
    assert "result 2: " in printed

    for stage in ("ar", "ar_control", "mars"):
        assert (out / stage / "config.json").is_file()
        assert MarsConfig.load(out / stage).stage == stage.split("_")[0]
    control = MarsConfig.load(out / "ar_control").extra["train"]
    assert control["steps"] == report["preset"]["after_ar"]["max_steps"]  # the MARS stage's budget, AR loss
    AutoModelForCausalLM.from_pretrained(out / "mars")
    AutoTokenizer.from_pretrained(out / "mars").apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def _report(ar, ar_families, mars, control=None):
    """A demo report with only what check_results reads; accuracies in percent. The control equals
    the AR parent unless given as (accuracy, families)."""

    def result(tau, acc, families, tpf=1.0):
        return {
            "tau": tau,
            "accuracy": acc / 100,
            "tokens_per_forward": tpf,
            "families": {f: {"accuracy": a / 100, "n": 125} for f, a in families.items()},
        }

    control = control or (ar, ar_families)
    return {
        "ar": {"results": [result(1.0, ar, ar_families)]},
        "ar_control": {"results": [result(1.0, *control)]},
        "mars": {"results": [result(tau, acc, fams, tpf) for tau, acc, fams, tpf in mars]},
        "ar_learning_curve": [{"step": 500, "accuracy": 0.90}, {"step": 1000, "accuracy": 0.91}],
    }


def test_check_results_judges_each_claim_at_its_edge():
    from marslm.demo.toy import check_results, format_checks

    families = {"arithmetic": 90.0, "lists": 60.0}
    # every claim met exactly at its threshold: equal overall, a family 2 points down, 2.0 tok/fwd, -2 points
    edge = _report(80.0, families, [(1.0, 80.0, {"arithmetic": 94.0, "lists": 58.0}, 1.0), (0.95, 78.0, families, 2.0)])
    checks = {c["result"]: c for c in check_results(edge) if c["met"] is not None or c["result"] == 3}
    assert [checks[r]["met"] for r in (0, 1, 2)] == [True, True, True]
    assert checks[3]["met"] is None and "+1.0 points" in checks[3]["detail"]
    # and each missed just past it
    assert not check_results(_report(59.0, families, []))[0]["met"]
    assert not check_results(_report(80.0, {"arithmetic": 99.0, "lists": 29.0}, []))[0]["met"]
    below = _report(80.0, families, [(1.0, 79.8, families, 1.0)])
    assert not check_results(below)[1]["met"]
    family_drop = _report(80.0, families, [(1.0, 81.0, {"arithmetic": 95.0, "lists": 57.6}, 1.0)])
    assert "lists -2.4" in check_results(family_drop)[1]["detail"] and not check_results(family_drop)[1]["met"]
    # result 1 is judged against the control; the parent's comparison is reported only
    beats_parent_not_control = _report(
        80.0, families, [(1.0, 81.0, families, 1.0)], control=(82.0, {"arithmetic": 92.0, "lists": 62.0})
    )
    judged, parent = check_results(beats_parent_not_control)[1:3]
    assert judged["met"] is False and "control" in judged["claim"] and "-1.0" in judged["detail"]
    assert parent["met"] is None and "+1.0" in parent["detail"]
    beats_control_not_parent = _report(85.0, families, [(1.0, 81.0, families, 1.0)], control=(80.0, families))
    assert check_results(beats_control_not_parent)[1]["met"] is True
    slow = _report(80.0, families, [(1.0, 80.0, families, 1.0), (0.95, 80.0, families, 1.99)])
    assert not check_results(slow)[3]["met"]
    lossy = _report(80.0, families, [(1.0, 80.0, families, 1.0), (0.95, 77.8, families, 2.5)])
    assert not check_results(lossy)[3]["met"]
    assert "MISSED" in format_checks(check_results(lossy)) and "not judged here" in format_checks(checks.values())


def test_learning_curve_steps_are_even_and_end_at_the_last_step():
    from marslm.demo.stages import curve_steps

    assert curve_steps(4000, 8) == [500, 1000, 1500, 2000, 2500, 3000, 3500, 4000]
    assert curve_steps(5500, 8) == [688, 1375, 2062, 2750, 3438, 4125, 4812, 5500]  # no extra point at 5496
    assert curve_steps(3, 6) == [1, 2, 3]


def test_smollm2_prompts_are_grouped_by_source_and_family():
    from marslm.demo.smollm2_measure import families, family_of

    items = [
        {"source": "toy", "id": "lists-0a1b"},
        {"source": "instructions", "id": "lists-9f9f"},
        {"source": "instructions", "id": "word_problem-77aa"},
        {"source": "toy", "id": "lists-c3c3"},
    ]
    assert family_of(items[2]) == "instructions/word_problem"
    assert families(items) == {"instructions/lists": [1], "instructions/word_problem": [2], "toy/lists": [0, 3]}


def test_demo_deletes_only_its_own_output_and_only_with_overwrite(tmp_path, monkeypatch, capsys):
    import marslm.demo.toy as demo
    from marslm.errors import UserError

    def stop_before_training(out, preset):
        raise UserError("stopped before training")

    monkeypatch.setattr(demo, "build_base_model", stop_before_training)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("mine")
    users = ["notes.txt", "src"]

    def demo_cli(*args) -> str:
        assert main(["demo", "--preset", "quick", "--quiet", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("marslm demo: error: ") and err.count("\n") == 1, err
        return err

    assert "pass --overwrite" in demo_cli("--out", ".")
    assert "is a file; give a directory" in demo_cli("--out", "notes.txt")
    assert "is a file; give a directory" in demo_cli("--out", "notes.txt", "--preset", "smollm2-quick")
    assert sorted(p.name for p in tmp_path.iterdir()) == users
    # a `base` of the user's own is not the demo's: nothing is replaced
    (tmp_path / "base").mkdir()
    assert "not a demo's output" in demo_cli("--out", ".", "--overwrite")
    assert (tmp_path / "base").is_dir()
    # an earlier (interrupted) demo here: --overwrite replaces its entries, and only those
    (tmp_path / demo.DEMO_MARKER).write_text("{}")
    for name in ("ar", "mars.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("old")
    (tmp_path / "report.json").write_text("{}")
    assert "stopped before training" in demo_cli("--out", ".", "--overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, demo.DEMO_MARKER])
    assert (tmp_path / "notes.txt").read_text() == (tmp_path / "src" / "main.py").read_text() == "mine"


def _trained_configs(tmp_path, monkeypatch, preset: str) -> list:
    """The TrainConfig of each stage a demo at ``preset`` trains, in order, with training and
    evaluation replaced by stand-ins."""
    import marslm.demo.toy as demo
    import marslm.training.recipe as recipe

    class Trained(Exception):
        pass

    def stop_after_training(*args, **kwargs):
        raise Trained

    trained = []
    monkeypatch.setattr(demo, "build_base_model", lambda out, preset: out / "base")
    monkeypatch.setattr(demo, "_learning_curve_callback", lambda *args, **kwargs: None)
    monkeypatch.setattr(recipe, "train", lambda cfg, callbacks=None: trained.append(cfg))
    monkeypatch.setattr(demo, "_evaluate_stages", stop_after_training)
    with pytest.raises(Trained):
        demo.run_demo(tmp_path, preset, progress=False)
    return trained


def test_quick_preset_trains_each_stage_with_these_settings(tmp_path, monkeypatch, capsys):
    from dataclasses import asdict

    from marslm.training.config import TrainConfig

    shared = dict(
        data="toy",
        data_n=2000,
        data_seed=0,
        seed=0,
        packing=True,
        batch_size=16,
        max_length=192,
        progress=False,
        logging_steps=25,
        save_steps=10**9,
        warmup_ratio=0.03,
        weight_decay=0.0,
    )
    stages = [
        dict(stage="ar", model="base", output="ar", max_steps=60, learning_rate=3e-3, data_mix={"lists": 2.0}),
        dict(stage="mars", model="ar", output="mars", max_steps=30, learning_rate=1e-3, block_size=4, ar_weight=1.0),
        # the control: the MARS stage's data, steps and schedule, with the AR loss
        dict(stage="ar", model="ar", output="ar_control", max_steps=30, learning_rate=1e-3),
    ]
    paths = ("model", "output")
    expected = [TrainConfig(**shared, **{**stage, **{k: str(tmp_path / stage[k]) for k in paths}}) for stage in stages]
    trained = _trained_configs(tmp_path, monkeypatch, "quick")
    assert [asdict(cfg) for cfg in trained] == [asdict(cfg) for cfg in expected]


@pytest.mark.parametrize("name", sorted(SMOLLM2_PRESETS))
def test_every_smollm2_preset_is_a_training_run_train_accepts(name, tmp_path):
    from marslm.demo.smollm2_presets import training_config

    cfg = training_config(
        SMOLLM2_PRESETS[name], tmp_path / "original", tmp_path / "train.jsonl", tmp_path / "mars", False
    )
    cfg.with_defaults().validate()
    assert cfg.exact and cfg.max_steps >= 2


def test_an_unknown_training_setting_in_a_preset_is_refused(tmp_path):
    from marslm.demo.smollm2_presets import training_config

    preset = resolve_preset("smollm2-quick", train={**SMOLLM2_PRESETS["smollm2-quick"].train, "lr_schedule": "wobbly"})
    with pytest.raises(UserError, match="lr_schedule|lr-schedule"):
        training_config(preset, tmp_path / "o", tmp_path / "t.jsonl", tmp_path / "m", False).validate()
