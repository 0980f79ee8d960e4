"""scripts/adapter_rank.py: a truncated copy of an exact checkpoint's gated LoRA is the best
low-rank approximation of each update, loads as a checkpoint, and keeps the original's outputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

import marslm
from marslm.adapter import FILENAME, adapter_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from adapter_rank import truncated  # noqa: E402


def test_truncation_keeps_a_low_rank_update_whole_and_cuts_the_rest_best():
    torch.manual_seed(0)
    a, b = torch.randn(8, 12), torch.randn(10, 8)
    b[:, 2:] = 0  # an update of rank 2 stored at rank 8
    full, kept = truncated({"rows": torch.zeros(1, 3), "lora.0.a": a, "lora.0.b": b}, 0.5, 2)
    assert kept == [1.0] and full["rows"].shape == (1, 3)
    torch.testing.assert_close(full["lora.0.b"].double() @ full["lora.0.a"].double(), 0.5 * b.double() @ a.double())
    b = torch.randn(10, 8)
    cut, kept = truncated({"lora.0.a": a, "lora.0.b": b}, 1.0, 3)
    s = torch.linalg.svdvals(b.double() @ a.double())
    error = torch.linalg.matrix_norm(cut["lora.0.b"].double() @ cut["lora.0.a"].double() - b.double() @ a.double())
    assert abs(error**2 - (s[3:] ** 2).sum()) < 1e-6  # Eckart-Young: the best rank-3 error
    assert abs(kept[0] - float((s[:3] ** 2).sum() / (s**2).sum())) < 1e-9


def test_the_copy_is_a_checkpoint_with_the_original_outputs(trained_dirs, tmp_path):
    exact = trained_dirs["dir"] / "exact"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "adapter_rank.py"), str(exact), "--ranks", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "rank 2: energy kept, mean" in run.stdout
    assert load_file(str(tmp_path / "r2" / FILENAME))["lora.0.a"].shape[0] == 2
    model, tokenizer = marslm.load(str(tmp_path / "r2"))
    assert adapter_of(model).spec.rank == 2
    original, _ = marslm.load(str(exact))
    ids = tokenizer("the same prompt", return_tensors="pt").input_ids
    with torch.no_grad():  # no mask in the input: the adapter, truncated or not, does nothing
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)
    refused = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "adapter_rank.py"), str(exact), "--ranks", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "ranks must be in 1..7, got 8" in refused.stderr
