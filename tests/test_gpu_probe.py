"""marslm/bench/gpu_probe.py --dry-run: the GPU probe runs end to end on tiny shapes, so it cannot rot
between the rare runs on a lent GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_probe_dry_run_reports_every_section(tmp_path):
    out = tmp_path / "probe.json"
    run = subprocess.run(
        [sys.executable, "-m", "marslm.bench.gpu_probe", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ["environment", "correctness", "attention", "train_step", "cost_curve", "generate"]
    for name, section in sections.items():
        assert "error" not in section and "skipped" not in section, (name, section)
    correctness = sections["correctness"]
    assert correctness["tau1_equals_hf_greedy_fp32"] == correctness["prompts"]
    assert correctness["lossless_equals_hf_greedy_fp32"] == correctness["prompts"]
    assert sections["attention"]["rows"][0]["flex_max_abs_diff_vs_sdpa"] < 1e-4
    steps = [row for run in sections["train_step"]["runs"] for row in run["rows"]]
    assert {row["stage"] for row in steps} == {"ar", "mars"} and all(row["seconds"] for row in steps)


def test_the_probe_refuses_a_machine_without_cuda_unless_dry(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = subprocess.run(
        [sys.executable, "-m", "marslm.bench.gpu_probe", "--out", str(tmp_path / "p.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--dry-run" in run.stderr
