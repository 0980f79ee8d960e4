"""MARS decoding: acceptance rule, the batched step loop and the ``generate`` entry point.

Names load on first use, so ``marslm.decode.acceptance`` (pure torch) imports without
transformers: the vLLM plugin runs it under the transformers version vLLM pins.
"""

from importlib import import_module

_EXPORTS = {
    "accept_length": "acceptance",
    "confidence": "acceptance",
    "DecodeBatch": "batch",
    "Decoder": "decoder",
    "make_decoder": "decoder",
    "FinishedRow": "rows",
    "BlockCachedBatch": "block_cache",
    "GenerationResult": "generation",
    "generate": "generation",
    "ADAPTIVE_WIDTH": "params",
    "MASK_BATCH_LIMIT": "params",
    "PAPER_RULE": "params",
    "CACHE_MODES": "params",
    "METRICS": "params",
    "MODES": "params",
    "DecoderOptions": "params",
    "DecodingParams": "params",
    "ParamError": "params",
    "check_tau": "params",
    "TextStream": "text",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'marslm.decode' has no attribute {name!r}")
