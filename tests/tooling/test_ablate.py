"""The ablation recipe: Jacobi decoding is greedy AR decoding, and a tiny ablation runs, writes its
outputs, and resumes without retraining."""

import json

import pytest
import torch

from marslm.chat import encode_prompt, stop_token_ids
from marslm.data import toy
from marslm.decode.jacobi import jacobi_generate


def test_jacobi_equals_hf_greedy(trained_checkpoints):
    model, tokenizer = trained_checkpoints["ar64"]  # float64: no argmax ties from rounding
    prompts = [ex.messages for ex in toy.make_split("train", 64, seed=0)[::8]]
    stop_ids = stop_token_ids(tokenizer, model.generation_config)

    for window in (1, 4):
        out = jacobi_generate(model, tokenizer, prompts, window=window, max_new_tokens=64)
        assert out.tokens_per_forward >= 1.0
        if window == 4:  # the memorised prompts do converge early: the multi-token path is exercised
            assert out.tokens_per_forward > 1.0
        assert all(f >= 1 for f in out.forwards)
        for prompt, ids in zip(prompts, out.token_ids):
            prompt_ids = encode_prompt(tokenizer, prompt)
            with torch.no_grad():
                expected = model.generate(
                    torch.tensor([prompt_ids]),
                    do_sample=False,
                    max_new_tokens=64,
                    eos_token_id=stop_ids,
                    pad_token_id=stop_ids[0],
                )[0, len(prompt_ids) :]
            expected = expected.tolist()
            if expected and expected[-1] in stop_ids:
                expected = expected[:-1]
            assert ids == expected


def _tiny() -> dict:
    """Overrides of the quick preset small enough to finish in about a minute on a busy 2-core machine."""
    from marslm.demo.presets import DEMO_PRESETS

    quick = DEMO_PRESETS["quick"]
    return dict(
        train_examples=200,
        test_examples=8,
        train={**quick.train, "batch_size": 8, "max_length": 64},
        ar={**quick.ar, "max_steps": 6},
        after_ar={**quick.after_ar, "max_steps": 3},
    )


@pytest.mark.slow
def test_ablation_writes_every_configuration_and_resumes(tmp_path, monkeypatch, capsys):
    import marslm.demo.ablate as ablate

    out = tmp_path / "ablate"
    reports = ablate.run_ablation(out, preset="quick", block_sizes=(2, 4), progress=False, **_tiny())
    labels = ["AR N", "AR 2N", "MARS B=2 w=1", "MARS B=2 w=0", "MARS B=4 w=1", "MARS B=4 w=0", "Jacobi (AR N)"]
    assert list(reports) == labels
    assert "[ablate] 4/7 MARS B=2 w=0: training" in capsys.readouterr().out

    saved = json.loads((out / "ablation.json").read_text())
    assert [k for k in saved if k != "preset"] == labels
    assert [c["tau"] for c in saved["AR 2N"]["results"]] == [1.0]
    assert [c["tau"] for c in saved["MARS B=4 w=0"]["results"]] == list(ablate.MARS_TAUS)
    assert saved["MARS B=2 w=1"]["results"][0]["block_size"] == 2
    trained_with = {
        slug: json.loads((out / slug / "marslm.json").read_text())["extra"]["train"]["masked_weighting"]
        for slug in ("mars_b4_w1", "mars_b4_w0")
    }
    assert trained_with == {"mars_b4_w1": "uniform", "mars_b4_w0": "inverse-t"}  # the reference's w/o-SFT loss
    jacobi = saved["Jacobi (AR N)"]["results"][0]
    assert jacobi["tokens_per_forward"] >= 1.0
    assert jacobi["accuracy"] == saved["AR N"]["results"][0]["accuracy"]  # same greedy outputs

    table = (out / "ablation.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| configuration")]
    assert [row.split(" | ")[0][2:] for row in rows] == labels
    assert (out / "frontier.png").stat().st_size > 0

    # Second run: every configuration is finished, so nothing trains or evaluates again.
    def refuse(*args, **kwargs):
        raise AssertionError("a finished configuration was trained again")

    monkeypatch.setattr(ablate, "train", refuse)
    monkeypatch.setattr(ablate, "evaluate", refuse)
    monkeypatch.setattr(ablate, "jacobi_report", refuse)
    again = ablate.run_ablation(out, preset="quick", block_sizes=(2, 4), progress=False, **_tiny())
    assert again == reports
    assert capsys.readouterr().out.count("done earlier, skipped") == len(labels)


def test_bad_output_paths_are_one_line_errors(tmp_path, capsys):
    from marslm.cli import main

    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    corrupt, listed = tmp_path / "corrupt", tmp_path / "listed"
    for directory, text in ((corrupt, '{"preset": '), (listed, "[]")):
        directory.mkdir()
        (directory / "ablation.json").write_text(text)
    for out, fragment in (
        (a_file, "is a file; give a directory"),
        (a_file / "sub", "a-file is a file, not a directory"),
        (corrupt, "ablation.json:1: malformed JSON"),
        (listed, "ablation.json holds a list, not an ablation"),
    ):
        assert main(["ablate", "--preset", "quick", "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("marslm ablate: error: ") and err.count("\n") == 1 and fragment in err, err
    assert a_file.read_text() == "mine"
    assert [p.name for p in corrupt.iterdir()] == [p.name for p in listed.iterdir()] == ["ablation.json"]
