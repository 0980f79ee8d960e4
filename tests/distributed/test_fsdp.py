"""FSDP: the accelerate config in the repo, and the MARS loss (target-only logits included)
under FSDP2 sharding on two CPU processes.

accelerate turns FSDP on only for GPU back-ends, so on a CPU the worker shards the model itself,
the way configs/accelerate/fsdp.yaml makes accelerate do it (FSDP2, each decoder layer, then the
root, a full state dict for saving).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_the_fsdp_config_is_fsdp2_with_a_full_state_dict():
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "accelerate" / "fsdp.yaml").read_text())
    assert config["distributed_type"] == "FSDP"
    assert config["fsdp_config"]["fsdp_version"] == 2
    assert config["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    assert config["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


def test_the_deepspeed_config_is_zero2_in_bf16_as_accelerate_reads_it():
    """What a CPU can check of configs/accelerate/deepspeed_zero2.yaml (docs/gpu.md): accelerate's
    own loader takes it, as ZeRO stage 2 in bf16, leaving accumulation and clipping to marslm train."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    assert config.distributed_type == DistributedType.DEEPSPEED
    assert config.deepspeed_config["zero_stage"] == 2
    assert config.mixed_precision == "bf16"
    assert not {"gradient_accumulation_steps", "gradient_clipping"} & set(config.deepspeed_config)


@pytest.mark.slow
def test_mars_loss_and_gradients_under_fsdp_match_one_process(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to the interpreter")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(
        [
            str(torchrun),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            str(ROOT / "tests/distributed/fsdp_worker.py"),
            str(tmp_path / "model"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["loss"] == pytest.approx(result["single_loss"], rel=1e-5)
    assert result["max_grad_diff"] < 1e-6
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert all(torch.isfinite(p).all() for p in saved.parameters())
