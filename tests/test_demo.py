"""The main job end to end, at the quick preset: every stage runs and the report is well formed."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from marslm.cli import main
from marslm.config import MarsConfig


@pytest.mark.slow
def test_quick_demo_writes_a_well_formed_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--preset", "quick", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| MARS B=4 | 0.95 |" in printed

    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"ar", "mars", "ar_learning_curve", "preset", "seconds"}
    assert [r["tau"] for r in report["ar"]["results"]] == [1.0]
    assert [r["tau"] for r in report["mars"]["results"]] == [1.0, 0.95, 0.9]
    for result in report["ar"]["results"] + report["mars"]["results"]:
        assert 0.0 <= result["accuracy"] <= 1.0
        assert result["tokens_per_forward"] >= 1.0
        assert set(result["families"]) == {"arithmetic", "format", "lists", "code"}
        assert sum(f["n"] for f in result["families"].values()) == result["n"]
    # one-token mode is AR decoding: exactly one token per forward
    assert report["mars"]["results"][0]["tokens_per_forward"] == 1.0
    assert report["ar_learning_curve"] and report["ar_learning_curve"][-1]["step"] == report["preset"]["ar_steps"]

    for stage in ("ar", "mars"):
        assert (out / stage / "config.json").is_file()
        assert MarsConfig.load(out / stage).stage == stage
    AutoModelForCausalLM.from_pretrained(out / "mars")
    AutoTokenizer.from_pretrained(out / "mars").apply_chat_template([{"role": "user", "content": "hi"}],
                                                                   tokenize=False)
