"""What trains: the mask token, which weights are frozen, LoRA, and exact mode's adapter.

Each function changes a loaded model in place (or wraps it) before ``Trainer`` sees it; the
recipe calls :func:`trainable_part` once with the stage's settings.
"""

from __future__ import annotations

import logging

import torch

from ..adapter import MaskAdapter, adapter_of, check_linear_names
from ..errors import UserError
from ..mars_json import MASK_TOKEN
from ..modeling import count_parameters
from .config import EXACT_RANK, TrainConfig

log = logging.getLogger("marslm.train")


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


def apply_lora(model, rank: int, alpha: float | None, train_layers: int | None, modules: list[str] | None = None):
    """LoRA adapters (peft) on the linear layers named in ``modules`` (every one by default) of the
    top ``train_layers`` decoder layers (all by default); every other weight is frozen.
    :func:`merge_lora` folds them back in before saving."""
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
    if modules is not None:
        check_linear_names(modules, set(linear))
        linear = sorted(modules)
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


def saved_parameters(model) -> int:
    """The parameters of the checkpoint a run saves: LoRA adapters are folded into the weights they
    adapt (:func:`merge_lora`) and exact mode's adapter is saved beside the model, so neither counts."""
    lora = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    adapter = adapter_of(model)
    return count_parameters(model) - lora - (0 if adapter is None else count_parameters(adapter))


def _parameter_split(model) -> dict:
    seen, split = set(), {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            split["trainable" if p.requires_grad else "frozen"] += p.numel()
    return split


def trainable_part(model, cfg: TrainConfig, mask_id: int | None):
    """Freeze what the config keeps fixed and wrap LoRA adapters; returns ``(model, mask row matrix)``,
    the second the embedding matrix when only the mask token's row of it trains (else None)."""
    mask_row = None
    if cfg.exact:
        model.requires_grad_(False)
        rank = EXACT_RANK if cfg.lora_rank is None else cfg.lora_rank
        rows = cfg.block_size if cfg.mask_rows == "per-offset" else 1
        adapter = MaskAdapter.for_model(
            model, mask_id, rank=rank, rows=rows, alpha=cfg.lora_alpha, modules=cfg.lora_modules
        )
        adapter.attach(model)
        mask_row = adapter.rows if cfg.mask_lr is not None else None
        log.warning(
            "exact mode: the model is frozen; training an adapter of %s parameters "
            "(%d mask rows, gated LoRA rank %d on %d Linears)",
            f"{count_parameters(adapter):,}",
            rows,
            rank,
            len(adapter.spec.targets),
        )
        return model, mask_row
    if cfg.mask_only:
        model.requires_grad_(False)
        mask_row = train_embedding_rows(model, [mask_id])
        what = "the mask token's embedding row"
    else:
        freeze_for_training(model, cfg.train_layers, cfg.freeze_embeddings)
        what = f"top {cfg.train_layers} layers" if cfg.train_layers else "all layers"
        if cfg.freeze_embeddings and not cfg.train_layers:
            what += ", embeddings frozen"
        if cfg.lora_rank:
            model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.train_layers, cfg.lora_modules)
            what = f"LoRA rank {cfg.lora_rank} on the {what}"
        if cfg.mask_lr is not None and mask_id is not None:
            mask_row = train_embedding_rows(model, [mask_id])
            what += f", and the mask token's embedding row at lr {cfg.mask_lr:g}"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad and p is not mask_row)
    trainable += 0 if mask_row is None else mask_row.shape[1]
    if what != "all layers":
        log.warning("training %s of %s parameters (%s)", f"{trainable:,}", f"{count_parameters(model):,}", what)
    return model, mask_row
