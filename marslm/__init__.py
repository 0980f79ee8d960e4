"""marslm: MARS (Mask AutoRegression) fine-tuning and multi-token decoding for HF causal LMs."""

from .config import MarsConfig
from .decode import GenerationResult, generate
from .errors import UserError

__version__ = "0.1.0"
__all__ = ["GenerationResult", "MarsConfig", "UserError", "generate", "__version__"]
