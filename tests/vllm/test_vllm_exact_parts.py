"""Exact checkpoints under vLLM, the parts that run without vLLM: the adapter's export to PEFT's
layout, where a step's masks are, the engine arguments, and the refusals. (The engine: test_vllm_exact.py.)"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from marslm.errors import UserError
from marslm.mars_json import ADAPTER_FILENAME, FILENAME, MarsConfig
from marslm.vllm.engine_args import engine_kwargs, plugin_config, server_args
from marslm.vllm.exact import ROWS_FILENAME, adapter_spec, export_lora, mask_gate
from marslm.vllm.proposer import MarsProposer
from marslm.vllm.request_settings import PluginConfig

M = 3  # the mask token of these rows
LINEARS = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


@pytest.fixture
def exact_copy(trained_dirs, tmp_path):
    """A copy of the toy's exact checkpoint that a test may damage."""
    return shutil.copytree(trained_dirs["dir"] / "exact", tmp_path / "exact")


def test_the_export_is_a_peft_lora_whose_update_is_the_adapters(exact_copy, tmp_path):
    """PEFT loads the exported LoRA onto the original model, and its update of every gated Linear is
    the adapter's own (``x a^T b^T alpha / r``): vLLM's LoRA then adds what marslm's hook adds. The
    record's alpha is made 3r, since training's default (alpha = r) would hide a scale left out."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exact = exact_copy
    record = json.loads((exact / FILENAME).read_text())
    record["adapter"]["alpha"] = 3.0 * record["adapter"]["rank"]
    (exact / FILENAME).write_text(json.dumps(record))
    spec = adapter_spec(exact, MarsConfig.load(exact))
    assert spec.alpha / spec.rank == 3.0
    lora = export_lora(exact, spec, cache=tmp_path / "cache")
    assert (lora.rank, lora.rows) == (spec.rank, spec.rows) and lora.modules == LINEARS
    config = json.loads(Path(lora.directory, "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == spec.rank  # the scale is folded into lora_B
    adapter = load_file(str(exact / ADAPTER_FILENAME))
    assert torch.equal(load_file(f"{lora.directory}/{ROWS_FILENAME}")["rows"], adapter["rows"])

    original = AutoModelForCausalLM.from_pretrained(exact, dtype=torch.float64)
    linears = {name: module for name, module in original.named_modules() if name in spec.targets}
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(exact), lora.directory).double()
    assert len(spec.targets) == 14
    for i, name in enumerate(spec.targets):
        x = torch.randn(5, linears[name].in_features, dtype=torch.float64)
        a, b = adapter[f"lora.{i}.a"].double(), adapter[f"lora.{i}.b"].double()
        expected = linears[name](x) + x @ a.T @ b.T * (spec.alpha / spec.rank)
        torch.testing.assert_close(peft.base_model.model.get_submodule(name)(x), expected, rtol=1e-6, atol=1e-6)


def test_the_export_is_written_once_per_adapter(exact_copy, tmp_path):
    spec = adapter_spec(exact_copy, MarsConfig.load(exact_copy))
    first = export_lora(exact_copy, spec, cache=tmp_path / "cache")
    assert export_lora(exact_copy, spec, cache=tmp_path / "cache") == first
    tensors = load_file(str(exact_copy / ADAPTER_FILENAME))
    tensors["rows"] = tensors["rows"] + 1
    save_file(tensors, str(exact_copy / ADAPTER_FILENAME))
    changed = export_lora(exact_copy, spec, cache=tmp_path / "cache")
    assert changed.directory != first.directory  # keyed by the file's bytes, never its name or date
    rescaled = export_lora(exact_copy, replace(spec, alpha=2 * spec.alpha), cache=tmp_path / "cache")
    assert rescaled.directory not in (first.directory, changed.directory)  # alpha is folded into lora_B
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_an_adapter_of_mask_rows_alone_exports_no_lora(exact_copy, tmp_path):
    record = json.loads((exact_copy / FILENAME).read_text())
    record["adapter"].update(rank=0, targets=[])
    (exact_copy / FILENAME).write_text(json.dumps(record))
    save_file({"rows": load_file(str(exact_copy / ADAPTER_FILENAME))["rows"]}, str(exact_copy / ADAPTER_FILENAME))
    lora = export_lora(exact_copy, adapter_spec(exact_copy, MarsConfig.load(exact_copy)), cache=tmp_path)
    assert lora.rank == 0 and lora.modules == ()
    assert sorted(p.name for p in (tmp_path / lora.directory).iterdir()) == [ROWS_FILENAME]
    kwargs = engine_kwargs(exact_copy, plugin=plugin_config(exact_copy))
    assert "enable_lora" not in kwargs and kwargs["additional_config"]["marslm"]["exact_rank"] == 0


def test_engine_arguments_of_an_exact_checkpoint(trained_dirs):
    exact = trained_dirs["dir"] / "exact"
    kwargs = engine_kwargs(exact, cpu=True)
    assert kwargs["enable_lora"] and kwargs["max_loras"] == 1 and kwargs["max_lora_rank"] == 8
    assert kwargs["lora_target_modules"] == list(LINEARS)
    config = PluginConfig.from_vllm_config(type("C", (), {"additional_config": kwargs["additional_config"]}))
    assert config == plugin_config(exact) and config.exact_rows == 4 and config.exact_lora
    args = server_args(kwargs)
    at = args.index("--lora-target-modules")
    assert args[at + 1 : at + 8] == kwargs["lora_target_modules"] and "--enable-lora" in args
    assert engine_kwargs(exact, cpu=False)["enforce_eager"]  # on a GPU too: no graph fixes the mask rows' branch
    # served plainly, the exact checkpoint is the original model: no drafts and no LoRA
    assert engine_kwargs(exact, speculative="none") == {"model": str(exact)}


def _damage_nan(path):
    tensors = load_file(str(path))
    tensors["lora.0.b"][0, 0] = float("nan")
    save_file(tensors, str(path))


def _damage_shape(path):
    tensors = load_file(str(path))
    tensors["lora.3.a"] = tensors["lora.3.a"][:, :-1].contiguous()
    save_file(tensors, str(path))


def _damage_missing(path):
    tensors = load_file(str(path))
    del tensors["lora.13.b"]
    save_file(tensors, str(path))


def _damage_truncate(path):
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize(
    "damage, message",
    [
        (_damage_nan, "lora.0.b holds NaN or infinite values"),
        (_damage_shape, "tensor lora.3.a has shape (8, 63)"),
        (_damage_missing, "has no tensor lora.13.b"),
        (_damage_truncate, "is not a readable adapter file"),
    ],
)
def test_a_damaged_adapter_is_refused_before_vllm_starts_in_one_line(exact_copy, tmp_path, damage, message):
    damage(exact_copy / ADAPTER_FILENAME)
    with pytest.raises(UserError, match=re.escape(message)):
        plugin_config(exact_copy)
    proc = subprocess.run(
        [sys.executable, "-m", "marslm.cli", "serve", "--engine", "vllm", "--model", str(exact_copy)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MARSLM_VLLM_VENV": str(tmp_path / "no-venv")},
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr


def test_an_adapter_for_other_weights_is_refused(exact_copy):
    config = json.loads((exact_copy / "config.json").read_text())
    config["hidden_size"] = 128
    (exact_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="hidden_size 64 is not the model's hidden size 128"):
        plugin_config(exact_copy)


def test_own_loras_beside_an_exact_checkpoint_are_refused(trained_dirs):
    from marslm.vllm.serve import build_argv

    exact = str(trained_dirs["dir"] / "exact")
    for flag in ("--lora-modules", "--enable-lora", "--max-loras=2"):
        with pytest.raises(UserError, match=f"{flag.split('=')[0]}: .* serves no other LoRA beside it"):
            build_argv([exact, "--", flag, "mine=/somewhere"])


@pytest.mark.parametrize(
    "scheduled, drafts, where, offsets",
    [
        ([7, 3], [[], []], [], []),  # prefill and plain rows: no drafts, no masks
        ([5], [[M, M, M, M]], [1, 2, 3, 4], [0, 1, 2, 3]),  # threshold: [x | M M M M]
        ([2, 7], [[], [11, 12, M, M, M, M]], [5, 6, 7, 8], [0, 1, 2, 3]),  # lossless: [x | d1 d2 M M M M]
        ([3], [[11, M]], [2], [0]),  # drafts cut short by the context's end
        ([9, 5], [[], [M, M, M, M]], [10, 11, 12, 13], [0, 1, 2, 3]),  # a prompt that holds M is not gated
    ],
)
def test_mask_gate_finds_each_rows_drafted_masks(scheduled, drafts, where, offsets):
    found, found_offsets = mask_gate(scheduled, drafts, M, rows=4)
    assert found.tolist() == where and found_offsets.tolist() == offsets


def test_mask_gate_clamps_offsets_to_a_shared_row():
    assert mask_gate([5], [[M, M, M, M]], M, rows=1)[1].tolist() == [0, 0, 0, 0]
    assert mask_gate(np.array([1, 5]), [[], [M] * 4], M, rows=4)[0].dtype == np.int64


def test_the_proposer_never_drafts_the_mask_token_as_a_prediction():
    """A draft of the mask id is read as a mask (hidden by the sampler, gated in an exact
    checkpoint), so a prediction equal to it ends the predictions drafted."""
    proposer = MarsProposer.__new__(MarsProposer)
    proposer.config = PluginConfig(mask_token_id=M, num_masks=4)
    assert proposer._predictions([11, 12]) == [11, 12]
    assert proposer._predictions([11, M, 12]) == [11]
    assert proposer._predictions([M]) == []


def test_vllm_serves_exact_checkpoints_in_the_engine_table():
    from marslm.serve.engines import ENGINES

    assert ENGINES["vllm"].serves == ("full", "exact")
