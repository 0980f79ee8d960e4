"""MARS decoding: acceptance rule, the batched step loop and the ``generate`` entry point."""

from .acceptance import METRICS, accept_length, check_tau, confidence
from .batch import CACHE_MODES, MODES, DecodeBatch, FinishedRow, RowSettings
from .generate import GenerationResult, generate

__all__ = ["METRICS", "CACHE_MODES", "MODES", "DecodeBatch", "FinishedRow", "GenerationResult", "RowSettings",
           "accept_length", "check_tau", "confidence", "generate"]
