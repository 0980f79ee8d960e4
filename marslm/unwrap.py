"""A model as the library reads it, whatever wraps it for training. The lowest layer: masks,
the adapter, the losses and loading all ask it, so it imports nothing of marslm."""

from __future__ import annotations


def unwrap_model(model):
    """The model inside a DDP/DeepSpeed-style wrapper (those expose it as ``.module``, not ``.config``)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def attention_implementation(model) -> str:
    return getattr(unwrap_model(model).config, "_attn_implementation", None) or "eager"
