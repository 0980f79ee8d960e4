"""Loading checkpoints (hub ids or local directories) and giving them a mask token.

MARS changes no model code: any ``AutoModelForCausalLM`` whose attention takes a 4-D mask works.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import MASK_TOKEN, MarsConfig
from .errors import UserError


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.exists(name)


def check_model_source(name_or_path: str) -> None:
    """Fail early, in one line, on a path that is not a model (before any heavy import work)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UserError(f"{name_or_path} is not a Hugging Face model directory (no config.json)")
    elif not _looks_like_hub_id(name_or_path):
        raise UserError(f"model not found: {name_or_path}")


def load_model(name_or_path: str, dtype: torch.dtype | str | None = None, attn_implementation: str = "sdpa",
               device: str | torch.device | None = None):
    """``(model, tokenizer, mars_config)``; ``mars_config`` is None for checkpoints marslm did not write."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_source(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype or "auto", attn_implementation=attn_implementation)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise UserError(f"cannot load model {name_or_path}: {first_line}") from None
    if device is not None:
        model.to(device)
    model.eval()
    mars_config = MarsConfig.load(name_or_path) if Path(name_or_path).is_dir() else None
    return model, tokenizer, mars_config


def ensure_mask_token(model, tokenizer, mask_token: str = MASK_TOKEN) -> int:
    """Id of the mask token, adding it if needed without growing the model when possible.

    Hub models often have spare embedding rows past the tokenizer's vocabulary (Qwen2.5: 151,936
    rows for 151,665 tokens); a new token takes the next id, which then lands on a spare row and
    the parameter count stays the same. Only when no row is spare does the embedding grow by one.
    """
    if mask_token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"extra_special_tokens": [mask_token]},
                                     replace_extra_special_tokens=False)
    mask_id = tokenizer.convert_tokens_to_ids(mask_token)
    rows = model.get_input_embeddings().weight.shape[0]
    if mask_id >= rows:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
    return mask_id


def count_parameters(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
