"""marslm: MARS (Mask AutoRegression) fine-tuning and multi-token decoding for HF causal LMs.

    import marslm
    out = marslm.generate(model, tokenizer, ["What is 2 + 3?"], tau=0.95)
    out.texts, out.tokens_per_forward

Heavy imports (torch, transformers) happen on first use, so ``marslm --help`` and argument
errors answer at once.
"""

from .config import MarsConfig
from .errors import UserError

__version__ = "0.1.0"
__all__ = ["DecoderOptions", "DecodingParams", "GenerationResult", "MarsConfig", "UserError", "generate", "__version__"]


def __getattr__(name):
    if name in ("generate", "GenerationResult", "DecodingParams", "DecoderOptions"):
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module 'marslm' has no attribute {name!r}")
