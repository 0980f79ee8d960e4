"""MARS decoding: acceptance rule, the batched step loop and the ``generate`` entry point."""

from .acceptance import METRICS, accept_length, confidence
from .batch import DecodeBatch, FinishedRow
from .block_cache import BlockCachedBatch
from .generate import CACHE_MODES, GenerationResult, generate
from .params import MODES, DecodingParams, ParamError, check_tau
from .text import TextStream

__all__ = ["CACHE_MODES", "METRICS", "MODES", "BlockCachedBatch", "DecodeBatch", "DecodingParams", "FinishedRow",
           "GenerationResult", "ParamError", "TextStream", "accept_length", "check_tau", "confidence", "generate"]
