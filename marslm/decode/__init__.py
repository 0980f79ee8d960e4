"""MARS decoding: acceptance rule, the batched step loop and the ``generate`` entry point."""

from .acceptance import METRICS, accept_length, check_tau, confidence
from .batch import MODES, DecodeBatch, FinishedRow, RowSettings
from .block_cache import BlockCachedBatch
from .generate import CACHE_MODES, GenerationResult, generate

__all__ = ["METRICS", "CACHE_MODES", "MODES", "DecodeBatch", "FinishedRow", "GenerationResult", "RowSettings",
           "BlockCachedBatch", "accept_length", "check_tau", "confidence", "generate"]
