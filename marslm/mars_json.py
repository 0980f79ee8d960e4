"""``marslm.json``: what a checkpoint was trained with, saved beside the plain HF files.

The model directory stays a plain ``save_pretrained`` directory that loads without marslm; this
small file only records what decoding needs to know (block size, mask token) and how the
checkpoint came to be.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import UserError
from .files import read_json

FILENAME = "marslm.json"
STAGES = ("ar", "mars")
MASK_TOKEN = "<|mask|>"
# The MARS block size B when nothing says otherwise (the paper's main setting).
DEFAULT_BLOCK_SIZE = 4


@dataclass
class MarsConfig:
    stage: str = "ar"  # "ar" (plain SFT) or "mars"
    block_size: int = DEFAULT_BLOCK_SIZE  # B the model was trained with (1 for AR SFT)
    mask_token: str = MASK_TOKEN
    mask_token_id: int | None = None
    ar_weight: float = 1.0
    base_model: str | None = None
    # Exact mode (adapter.py): the adapter's shape; its weights are in mars_adapter.safetensors and
    # the model files are the original's. None: full mode, every trained weight is in the model.
    adapter: dict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.adapter is not None

    def save(self, directory: str | Path) -> None:
        Path(directory, FILENAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> MarsConfig | None:
        """The directory's ``marslm.json`` (None: there is none); refuses one that is not a valid record."""
        path = Path(directory, FILENAME)
        if not path.is_file():
            return None
        raw = read_json(path, hint="; restore it or remove it")
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold a JSON object, got {type(raw).__name__}; restore it or remove it")
        config = cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        config.validate(path)
        return config

    def validate(self, where: str | Path) -> None:
        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if self.stage not in STAGES:
            raise UserError(f"{where}: stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        if not is_int(self.block_size) or self.block_size < 1:
            raise UserError(f"{where}: block_size must be an integer >= 1, got {self.block_size!r}")
        if self.mask_token_id is not None and (not is_int(self.mask_token_id) or self.mask_token_id < 0):
            raise UserError(f"{where}: mask_token_id must be a token id (an integer >= 0), got {self.mask_token_id!r}")
        if self.adapter is not None and not isinstance(self.adapter, dict):
            raise UserError(f"{where}: adapter must be a JSON object, got {type(self.adapter).__name__}")
