"""``marslm.json``: what a checkpoint was trained with, saved beside the plain HF files.

The model directory stays a plain ``save_pretrained`` directory that loads without marslm; this
small file only records what decoding needs to know (block size, mask token) and how the
checkpoint came to be.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FILENAME = "marslm.json"
MASK_TOKEN = "<|mask|>"
# Learning-rate schedules `train` offers: Trainer's names for those that need nothing beyond the
# warmup and the step count. Here rather than in train.py so the CLI can list them without torch.
LR_SCHEDULES = ("cosine", "linear", "constant_with_warmup")
# Loss normalisations and masked-stream weightings (objective.py); here for the same reason.
NORMALIZATIONS = ("sequence", "token")
MASKED_WEIGHTINGS = ("uniform", "inverse-t")


@dataclass
class MarsConfig:
    stage: str = "ar"                 # "ar" (plain SFT) or "mars"
    block_size: int = 4               # B the model was trained with (1 for AR SFT)
    mask_token: str = MASK_TOKEN
    mask_token_id: int | None = None
    ar_weight: float = 1.0
    base_model: str | None = None
    extra: dict = field(default_factory=dict)

    def save(self, directory: str | Path) -> None:
        Path(directory, FILENAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "MarsConfig | None":
        path = Path(directory, FILENAME)
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)
