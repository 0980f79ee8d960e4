"""Exact checkpoints under vLLM: the gated adapter served as vLLM's own LoRA, read by mask tokens alone.

An exact checkpoint is the original model's files plus ``mars_adapter.safetensors`` (adapter.py):
mask rows, and a low-rank update of each decoder Linear that acts at mask positions only, so every
clean token's output is the original's. vLLM's LoRA kernels take one adapter index per token (punica;
-1 is none), so the update is served as a vLLM LoRA whose index is marslm's at the masks the
proposer drafted and none everywhere else. The mask rows have no home in vLLM's LoRA: it has no
extra vocabulary rows, and its embedding LoRA needs one in-vocabulary id per offset and a model that
declares its embedding modules. So the runner's embedding is wrapped instead: at a mask position
its output is the row of that mask's offset (exact_runner.py).

This module needs no vLLM (the CLI calls it while it builds the server's command line):

    export_lora    proves the adapter file and writes its LoRA in PEFT's layout, the layout vLLM
                   loads, into a cache directory keyed by what it is written from
    mask_gate      where one step's masks are in vLLM's flat token layout, and their offsets
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..files import cache_root
from ..mars_json import ADAPTER_FILENAME, AdapterSpec, MarsConfig, ModelLimits
from ..mars_json import FILENAME as MARS_JSON

LORA_ID = 1  # vLLM's id of the one adapter; 0 means none
LORA_NAME = "marslm-exact"
ROWS_FILENAME = "mask_rows.safetensors"
# The ranks vLLM compiles its LoRA buffers for (vllm/config/lora.py); a rank between two is padded up
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
EXPORT_VERSION = 1  # bumped when the written layout changes, so that old cache entries are not read


@dataclass(frozen=True)
class ExactLoRA:
    """What the engine needs of an exact checkpoint's adapter once it is exported."""

    directory: str  # PEFT adapter (when rank > 0) and the mask rows
    rank: int  # 0: mask rows only, no LoRA
    rows: int  # mask rows: 1 shared, or one per offset
    modules: tuple[str, ...]  # the gated Linears' own names (q_proj, ...): vLLM's lora_target_modules


def vllm_lora_rank(rank: int) -> int:
    """The LoRA rank vLLM is started with for an adapter of ``rank``: the next it has buffers for."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def adapter_spec(model_dir: str | Path, mars: MarsConfig) -> AdapterSpec | None:
    """The adapter entry of ``mars`` (``model_dir``'s ``marslm.json``), the record checked against the
    model's ``config.json`` first (None: not an exact checkpoint)."""
    if not mars.exact:
        return None
    config = _model_config(model_dir)
    where = Path(model_dir, MARS_JSON)
    mars.validate(where, ModelLimits.read(config.get))
    if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise UserError(
            f"{model_dir} is an exact checkpoint of a mixture-of-experts model: vLLM's CPU LoRA has no "
            "expert kernels; serve it with marslm serve --engine marslm"
        )
    spec = AdapterSpec.from_dict(mars.adapter, where)  # (checked against the model by validate)
    if spec.rank > VLLM_LORA_RANKS[-1]:
        raise UserError(f"{where}: adapter.rank {spec.rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")
    return spec


def export_lora(model_dir: str | Path, spec: AdapterSpec, cache: str | Path | None = None) -> ExactLoRA:
    """The adapter of ``model_dir``, proved (its tensors are the ones ``spec`` and the model's weight
    shapes call for, all finite) and written where vLLM reads it: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (rank > 0) and ``mask_rows.safetensors``, in a directory of
    ``cache`` named by a digest of what it is written from: the adapter file's bytes, and the
    entry's rank, alpha and targets. The checkpoint's own files are left as they are.

    The LoRA scale alpha / rank is folded into ``lora_B`` and the config says alpha = r, so vLLM's
    scaling is exactly 1 whatever alpha training used.
    """
    from safetensors.torch import save_file

    from ..adapter_proof import check_tensors, read_tensors

    path = Path(model_dir, ADAPTER_FILENAME)
    tensors = read_tensors(path)
    check_tensors(tensors, _expected_tensors(model_dir, spec), path)
    modules = tuple(sorted({name.rsplit(".", 1)[-1] for name in spec.targets})) if spec.rank else ()
    digest = hashlib.sha256(path.read_bytes())
    digest.update(json.dumps([spec.rank, spec.alpha, list(spec.targets)]).encode())  # alpha folds into lora_B
    digest = digest.hexdigest()[:24]
    directory = Path(cache or cache_root() / "vllm-lora", f"{digest}-v{EXPORT_VERSION}")
    result = ExactLoRA(str(directory), spec.rank, spec.rows, modules)
    if (directory / ROWS_FILENAME).is_file():
        return result
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".export-"))
    try:
        save_file({"rows": tensors["rows"].float().contiguous()}, str(work / ROWS_FILENAME))
        if spec.rank:
            scale = spec.alpha / spec.rank
            lora = {}
            for i, name in enumerate(spec.targets):
                lora[f"base_model.model.{name}.lora_A.weight"] = tensors[f"lora.{i}.a"].float().contiguous()
                lora[f"base_model.model.{name}.lora_B.weight"] = (tensors[f"lora.{i}.b"].double() * scale).float()
            save_file(lora, str(work / "adapter_model.safetensors"))
            config = {
                "peft_type": "LORA",
                "r": spec.rank,
                "lora_alpha": spec.rank,
                "target_modules": list(modules),
                "bias": "none",
                "base_model_name_or_path": str(Path(model_dir).resolve()),
            }
            (work / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        try:
            os.replace(work, directory)
        except OSError:  # another process exported the same adapter first: theirs is the same bytes
            if not (directory / ROWS_FILENAME).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _model_config(model_dir) -> dict:
    from ..files import read_json

    config = read_json(Path(model_dir, "config.json"), hint="; restore the model's config")
    text = config.get("text_config") if isinstance(config, dict) else None
    return text if isinstance(text, dict) else config


def _expected_tensors(model_dir, spec: AdapterSpec) -> dict:
    """Empty tensors of the shapes the adapter must hold, from the base weights' safetensors headers."""
    import torch

    shapes = _weight_shapes(model_dir)
    expected = {"rows": torch.empty(spec.rows, spec.hidden_size, device="meta")}
    for i, name in enumerate(spec.targets if spec.rank else ()):
        shape = shapes.get(f"{name}.weight")
        if shape is None or len(shape) != 2:
            raise UserError(f"{model_dir}: the adapter gates {name}, which the model's weights do not hold")
        out_features, in_features = shape
        expected[f"lora.{i}.a"] = torch.empty(spec.rank, in_features, device="meta")
        expected[f"lora.{i}.b"] = torch.empty(out_features, spec.rank, device="meta")
    return expected


def _weight_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    """Every weight's shape, read from the headers of the model's safetensors files (no weights load)."""
    from safetensors import safe_open

    files = [f for f in sorted(Path(model_dir).glob("*.safetensors")) if f.name != ADAPTER_FILENAME]
    if not files:
        raise UserError(f"{model_dir} holds no safetensors weights; vLLM serves exact checkpoints from safetensors")
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as weights:
                for key in weights.keys():
                    shapes[key] = tuple(weights.get_slice(key).get_shape())
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
            reason = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
            raise UserError(f"{file} is not a readable safetensors file ({reason})") from None
    return shapes


def mask_gate(num_scheduled, drafts, mask_token_id: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Where one step's masks sit in vLLM's flat token layout, and each one's offset in its block.

    ``num_scheduled[i]`` tokens of row i run this step, and its drafts (``drafts[i]``) are the last
    of them. A draft equal to ``mask_token_id`` is a mask: the proposer drafts masks as that id and
    never drafts a prediction equal to it. The k-th mask of a row reads row ``min(k, rows - 1)``.
    Prompt and re-fed tokens are never drafts, so they are never gated, whatever their id.
    """
    counts = np.asarray(num_scheduled, dtype=np.int64)
    ends = np.cumsum(counts)
    where, offsets = [], []
    for end, draft in zip(ends, drafts):
        draft = np.asarray(draft, dtype=np.int64)
        if not len(draft):
            continue
        masks = np.flatnonzero(draft == mask_token_id)
        where.append(end - len(draft) + masks)
        offsets.append(np.minimum(np.arange(len(masks)), rows - 1))
    if not where:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(where), np.concatenate(offsets)
