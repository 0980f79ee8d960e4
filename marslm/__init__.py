"""marslm: MARS (Mask AutoRegression) fine-tuning and multi-token decoding for HF causal LMs.

    import marslm
    out = marslm.generate(model, tokenizer, ["What is 2 + 3?"], tau=0.95)
    out.texts, out.tokens_per_forward

Heavy imports (torch, transformers) happen on first use, so ``marslm --help`` and argument
errors answer at once.
"""

from .errors import UserError
from .mars_json import MarsConfig

__version__ = "0.1.0"
__all__ = [
    "DecoderOptions",
    "DecodingParams",
    "GenerationResult",
    "MarsConfig",
    "UserError",
    "generate",
    "load",
    "__version__",
]


def load(path: str, dtype=None, device=None):
    """``(model, tokenizer)`` of a checkpoint marslm wrote, in either mode, ready for
    :func:`marslm.generate`: an exact-mode checkpoint comes with its adapter attached (plain
    ``from_pretrained`` gives the original model, which decodes one token per forward).
    ``dtype``: as saved unless given; ``device``: the CPU unless given ("auto": the GPU if any)."""
    from .modeling import load_model, resolve_device

    model, tokenizer, _ = load_model(path, dtype=dtype, device=resolve_device(device))
    return model, tokenizer


def __getattr__(name):
    if name in ("generate", "GenerationResult", "DecodingParams", "DecoderOptions"):
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module 'marslm' has no attribute {name!r}")
