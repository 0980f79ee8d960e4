"""Loading checkpoints (hub ids or local directories) and giving them a mask token.

MARS changes no model code: any ``AutoModelForCausalLM`` whose attention takes a 4-D mask works.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError
from .mars_json import FILENAME as CONFIG_FILENAME
from .mars_json import MASK_TOKEN, AdapterSpec, MarsConfig, ModelLimits
from .unwrap import unwrap_model

log = logging.getLogger("marslm")


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.exists(name)


# The files from_pretrained reads a PyTorch model's weights from (one, or an index of shards).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_source(name_or_path: str) -> None:
    """Fail early, in one line, on a path that is not a model (before any heavy import work)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UserError(f"{name_or_path} is not a Hugging Face model directory (no config.json)")
        if not any((path / name).is_file() for name in WEIGHT_FILES):
            raise UserError(
                f"{name_or_path} is not a checkpoint: it has a config.json but no weights ({WEIGHT_FILES[0]} "
                f"or {WEIGHT_FILES[2]})"
            )
    elif not _looks_like_hub_id(name_or_path):
        raise UserError(f"model not found: {name_or_path}")


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
):
    """``(model, tokenizer, mars_config)``; ``mars_config`` is None for checkpoints marslm did not write
    (with a warning saying what decoding then assumes). Anything unloadable is a :class:`UserError`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_source(name_or_path)
    mars_config = saved_config(name_or_path)  # before the slow part
    with loading_errors(name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype or "auto", attn_implementation=attn_implementation
        )
    check_tokenizer(tokenizer, name_or_path)
    if mars_config is None:
        log.warning(
            "%s has no %s (marslm train writes one): decoding assumes block size %d and the %s token",
            name_or_path,
            CONFIG_FILENAME,
            MarsConfig().block_size,
            MASK_TOKEN,
        )
    elif mars_config.exact:
        from .adapter import load as load_adapter

        load_adapter(AdapterSpec.from_dict(mars_config.adapter, name_or_path), name_or_path, model)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer, mars_config


@contextmanager
def loading_errors(name_or_path: str):
    """Whatever loading a checkpoint raises (a truncated or empty safetensors file, a broken config,
    a missing file) becomes one line naming the checkpoint."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the libraries raise many types for a bad file
        lines = str(exc).strip().splitlines()
        reason = f"{exc.__class__.__name__}: {lines[0]}" if lines else exc.__class__.__name__
        raise UserError(f"cannot load model {name_or_path}: {reason}") from None


def check_tokenizer(tokenizer, name_or_path: str) -> None:
    """A tokenizer that turns text into no tokens is missing its vocabulary (tokenizer.json), and
    would decode every answer to empty text."""
    if not tokenizer("Hello, world 123", add_special_tokens=False)["input_ids"]:
        raise UserError(
            f"the tokenizer of {name_or_path} turns text into no tokens: its vocabulary is missing (no tokenizer.json?)"
        )


def cpu_threads(requested: int | None = None) -> int:
    """Intra-op threads for a model that serves requests on the CPU: ``requested``, or the cores
    this process may use less one (at least 1). A server's HTTP front end, tokenizer and clients
    need a core too; given every core, the forward's threads wait on each other whenever one of
    them is preempted, and a step with several tokens (a parallel matrix multiply) suffers most."""
    if requested is not None:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def resolve_device(device: str | None) -> str | None:
    """``auto``: the GPU when there is one, else the CPU (None); otherwise a device this machine has."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else None
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {device!r} (expected auto, cpu, cuda, cuda:N, mps, ...)") from None
    if parsed.type == "cuda" and (not torch.cuda.is_available() or (parsed.index or 0) >= torch.cuda.device_count()):
        raise UserError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError("device 'mps': not available on this machine")
    return device


@dataclass(frozen=True)
class CheckpointFacts:
    """What decoding needs to know about a checkpoint, read once."""

    stage: str | None  # "ar" | "mars" from marslm.json; None for checkpoints marslm did not write
    block_size: int  # the B it was trained with (4 when it does not say)
    mask_token_id: int | None  # None: the tokenizer has no mask token
    pad_id: int


def saved_config(name_or_path: str) -> MarsConfig | None:
    """A checkpoint directory's ``marslm.json`` (None: a hub id, or a checkpoint marslm did not write),
    checked against the model's own config before anything it sizes is built."""
    if not Path(name_or_path).is_dir():
        return None
    has_record = Path(name_or_path, CONFIG_FILENAME).is_file()
    return MarsConfig.load(name_or_path, model_limits(name_or_path) if has_record else None)


def model_limits(directory: str) -> ModelLimits | None:
    """What a checkpoint directory's ``config.json`` bounds in its ``marslm.json`` (None: it has none)."""
    if not Path(directory, "config.json").is_file():
        return None
    from transformers import AutoConfig

    with loading_errors(directory):
        config = AutoConfig.from_pretrained(directory)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelLimits.read(lambda name: getattr(text, name, None))


def trained_block_size(config: MarsConfig | None) -> int:
    """The block size a checkpoint was trained with, from its ``marslm.json`` (read before the
    model loads): a MARS stage's B, else the default."""
    return config.block_size if config and config.stage == "mars" else MarsConfig().block_size


def checkpoint_facts(model, tokenizer, mask_token_id: int | None = None) -> CheckpointFacts:
    """Block size, mask token and padding id of a loaded model, from its ``marslm.json`` and tokenizer."""
    path = getattr(model, "name_or_path", None)
    config = saved_config(path) if path else None
    from .adapter import adapter_of

    # an exact checkpoint loaded without its adapter (plain from_pretrained) is the original model,
    # which has no mask to decode with
    without_adapter = config is not None and config.exact and adapter_of(model) is None
    if mask_token_id is None and config is not None and not without_adapter:
        mask_token_id = config.mask_token_id
    if mask_token_id is None and not without_adapter:
        token = config.mask_token if config else MASK_TOKEN
        if token in tokenizer.get_vocab():
            mask_token_id = tokenizer.convert_tokens_to_ids(token)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return CheckpointFacts(config.stage if config else None, trained_block_size(config), mask_token_id, pad_id)


def checkpoint_block_size(name_or_path: str) -> int:
    """The block size :func:`checkpoint_facts` will give a checkpoint, read before it loads."""
    return trained_block_size(saved_config(name_or_path))


def model_context(model_or_path) -> int | None:
    """The longest sequence a model takes (``max_position_embeddings``; None: it does not say): a
    loaded model's, or a checkpoint's from its config alone, so a setting that cannot fit is
    refused before the weights load."""
    if isinstance(model_or_path, (str, os.PathLike)):
        from transformers import AutoConfig

        with loading_errors(model_or_path):
            config = AutoConfig.from_pretrained(model_or_path)
    else:
        config = unwrap_model(model_or_path).config
    return getattr(config, "max_position_embeddings", None)


def warn_untrained_masks(name_or_path: str, what: str) -> None:
    """One line: an AR checkpoint (its masks never trained) is asked to accept its masks' guesses."""
    log.warning(
        "%s is an AR checkpoint (marslm.json stage 'ar'): its masks were never trained, so %s accepts "
        "untrained guesses; use tau 1, or a MARS checkpoint",
        name_or_path,
        what,
    )


def saved_mask_token(name_or_path: str) -> bool:
    """Whether :func:`checkpoint_facts` will find a mask token once the checkpoint loads, read
    before it loads (its marslm.json, else its tokenizer's vocabulary)."""
    config = saved_config(name_or_path)
    if config is not None and config.mask_token_id is not None:
        return True
    from transformers import AutoTokenizer

    with loading_errors(name_or_path):
        vocab = AutoTokenizer.from_pretrained(name_or_path).get_vocab()
    return (config.mask_token if config else MASK_TOKEN) in vocab


def count_parameters(model) -> int:
    """Distinct parameter values: tied weights count once (by storage, since tying can share the
    tensor without sharing the Parameter object)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel()
    return total
