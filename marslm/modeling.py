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

from .config import FILENAME as CONFIG_FILENAME
from .config import MASK_TOKEN, MarsConfig
from .errors import UserError

log = logging.getLogger("marslm")


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
        from . import adapter

        adapter.load(adapter.AdapterSpec.from_dict(mars_config.adapter, name_or_path), name_or_path, model)
    elif mars_config.mask_token_id is not None:
        rows = model.get_input_embeddings().weight.shape[0]
        if mars_config.mask_token_id >= rows:
            raise UserError(
                f"{name_or_path}: {CONFIG_FILENAME} names mask_token_id {mars_config.mask_token_id}, "
                f"outside the model's vocabulary (0..{rows - 1})"
            )
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


def ensure_mask_token(model, tokenizer, mask_token: str = MASK_TOKEN, vocab_multiple: int = 1) -> int:
    """Id of the mask token, adding it if needed without growing the model when possible.

    Hub models often have spare embedding rows past the tokenizer's vocabulary (Qwen2.5: 151,936
    rows for 151,665 tokens); a new token takes the next id, which then lands on a spare row and
    the parameter count stays the same. Only when no row is spare does the embedding grow, to the
    next multiple of ``vocab_multiple`` rows: an odd vocabulary misaligns the output projection's
    matrix multiplies and does not divide across tensor-parallel ranks.

    Grown rows start as the mean of the existing rows (input and output embedding alike). As an
    input the mask is a neutral token; as an output row (tied embeddings make it one) its logit is
    the mean of the others, so it can never be the greedy choice and one-token decoding is
    unchanged. It also stays sensible when training freezes the embeddings (``freeze_for_training``).
    """
    if mask_token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"extra_special_tokens": [mask_token]}, replace_extra_special_tokens=False)
    mask_id = tokenizer.convert_tokens_to_ids(mask_token)
    rows = model.get_input_embeddings().weight.shape[0]
    if mask_id >= rows:
        model.resize_token_embeddings(mask_id + 1, pad_to_multiple_of=vocab_multiple, mean_resizing=False)
        with torch.no_grad():
            for embedding in {
                id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
            }.values():
                embedding.weight[rows:] = embedding.weight[:rows].mean(dim=0)
    return mask_id


def freeze_for_training(model, train_layers: int | None = None, freeze_embeddings: bool = False) -> dict:
    """Train only the top ``train_layers`` decoder layers (and the final norm), or all but the embeddings.

    Freezing the embeddings and every layer below the lowest trained one means autograd never
    goes below it: the backward pass costs only the trained layers. With tied embeddings the
    output projection is the embedding matrix, so it is frozen with it (a trainable lm_head would
    make the input embedding trainable too, and the backward would run through every layer).
    Returns ``{"trainable": n, "frozen": n}`` parameter counts (tied weights counted once).
    """
    if train_layers is None and not freeze_embeddings:
        return _parameter_split(model)
    layers = model.get_decoder().layers
    if train_layers is not None:
        if not 1 <= train_layers <= len(layers):
            raise UserError(f"--train-layers must be in 1..{len(layers)} for this model, got {train_layers}")
        freeze_embeddings = True
        for layer in layers[: len(layers) - train_layers]:
            layer.requires_grad_(False)
    if freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
        if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
            model.get_output_embeddings().requires_grad_(False)
    return _parameter_split(model)


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them.

    Non-reentrant checkpointing needs no gradient on a layer's input. transformers still hooks the
    input embeddings so that their output requires grad (what reentrant checkpointing and adapters
    need), and that alone would run the backward through every frozen layer below
    ``--train-layers``: the hook is removed again. A layer that does not require grad is then not
    recomputed either, since nothing flows back through it.
    """
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()
    model.config.use_cache = False


def train_embedding_rows(model, rows: list[int]) -> torch.nn.Parameter:
    """Make only ``rows`` of the input embedding trainable (the mask token's, say); returns the matrix.

    The whole matrix requires grad, and a hook zeroes the gradient of every other row before any
    optimizer sees it: with no weight decay on it (train.py gives it a group of its own), Adam
    then leaves those rows exactly as they were. The backward has to reach the input, so it runs
    through every layer, frozen ones included (their weights get no gradient).
    """
    weight = model.get_input_embeddings().weight
    keep = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
    keep[list(rows)] = 1
    weight.requires_grad_(True)
    weight.register_hook(lambda grad: grad * keep.to(grad.dtype))
    return weight


def apply_lora(model, rank: int, alpha: float | None, train_layers: int | None):
    """LoRA adapters (peft) on every linear layer of the top ``train_layers`` decoder layers (all by
    default); every other weight is frozen. :func:`merge_lora` folds them back in before saving."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("--lora-rank needs peft: pip install 'marslm[lora]'") from None
    decoder_layers = model.get_decoder().layers
    n_layers = len(decoder_layers)
    layers = list(range(n_layers - train_layers, n_layers)) if train_layers else None
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in decoder_layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    )
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=linear,
        layers_to_transform=layers,
        lora_dropout=0.0,
        bias="none",
    )
    return get_peft_model(model, config)


def merge_lora(model):
    """The plain model with any LoRA adapters folded into its weights (the model itself if none)."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def _parameter_split(model) -> dict:
    seen, split = set(), {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            split["trainable" if p.requires_grad else "frozen"] += p.numel()
    return split


@dataclass(frozen=True)
class CheckpointFacts:
    """What decoding needs to know about a checkpoint, read once."""

    stage: str | None  # "ar" | "mars" from marslm.json; None for checkpoints marslm did not write
    block_size: int  # the B it was trained with (4 when it does not say)
    mask_token_id: int | None  # None: the tokenizer has no mask token
    pad_id: int


def saved_config(name_or_path: str) -> MarsConfig | None:
    """A checkpoint directory's ``marslm.json`` (None: a hub id, or a checkpoint marslm did not write)."""
    return MarsConfig.load(name_or_path) if Path(name_or_path).is_dir() else None


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


def model_context(name_or_path: str) -> int | None:
    """The longest sequence a checkpoint takes (``max_position_embeddings``; None: it does not say),
    from its config alone, so a setting that cannot fit is refused before the weights load."""
    from transformers import AutoConfig

    with loading_errors(name_or_path):
        config = AutoConfig.from_pretrained(name_or_path)
    return getattr(config, "max_position_embeddings", None)


def unwrap_model(model):
    """The model inside a DDP/DeepSpeed-style wrapper (those expose it as ``.module``, not ``.config``)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def attention_implementation(model) -> str:
    return getattr(unwrap_model(model).config, "_attn_implementation", None) or "eager"


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
