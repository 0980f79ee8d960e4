"""``marslm.json``: what a checkpoint was trained with, saved beside the plain HF files.

The model directory stays a plain ``save_pretrained`` directory that loads without marslm; this
small file only records what decoding needs to know (block size, mask token) and how the
checkpoint came to be. It is read through one validator, :meth:`MarsConfig.load`: every field's
type and, given the model's :class:`ModelLimits`, its bounds, before anything it sizes is allocated.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from .errors import UserError
from .files import read_json

log = logging.getLogger("marslm")

FILENAME = "marslm.json"
# Exact mode's adapter weights, beside marslm.json (adapter.py writes and reads them)
ADAPTER_FILENAME = "mars_adapter.safetensors"
STAGES = ("ar", "mars")
MASK_TOKEN = "<|mask|>"
# The MARS block size B when nothing says otherwise (the paper's main setting).
DEFAULT_BLOCK_SIZE = 4
_warned: set = set()  # (file, unknown keys) already named: a command reads its checkpoint's record several times


@dataclass(frozen=True)
class ModelLimits:
    """What the model beside a ``marslm.json`` bounds (None: its config does not say)."""

    vocab_rows: int | None  # its embedding's rows
    hidden_size: int | None
    context: int | None  # max_position_embeddings

    @classmethod
    def read(cls, get) -> ModelLimits:
        """The limits in a model's config, each field read by ``get(name)``; anything but a
        positive integer there is unknown (None)."""

        def positive(name: str) -> int | None:
            value = get(name)
            return value if _is_int(value) and value > 0 else None

        return cls(positive("vocab_size"), positive("hidden_size"), positive("max_position_embeddings"))


def _is_int(value) -> bool:
    # bool is an int subclass: True would pass for 1
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(where, name: str, value, low: int, high: int | None = None, why: str = "") -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise UserError(f"{where}: {name} must be an integer {bound}{why}, got {value!r}")


@dataclass(frozen=True)
class AdapterSpec:
    """The shape of an exact-mode adapter (adapter.py); saved in ``marslm.json`` as the ``adapter`` entry."""

    mask_token_id: int
    hidden_size: int
    rows: int  # mask embedding rows: 1 (shared) or B (one per offset inside a block)
    rank: int  # LoRA rank; 0 trains the mask rows alone
    alpha: float  # LoRA scale alpha / rank
    targets: tuple[str, ...]  # the gated Linears, by their names in the model
    # adapter.base_fingerprints of the weights it was trained on, by dtype (None: written before them)
    base_fingerprint: dict | None = field(default=None, hash=False)

    @classmethod
    def from_dict(cls, raw, where, limits: ModelLimits | None = None, block_size: int | None = None) -> AdapterSpec:
        """The entry ``raw`` checked field by field, against ``limits`` and the record's ``block_size`` where given."""
        if not isinstance(raw, dict):
            raise UserError(f"{where}: adapter must be a JSON object, got {type(raw).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in raw]
        if missing:
            raise UserError(f"{where}: the adapter entry has no {missing[0]}")
        _warn_unknown(where, "adapter entry", set(raw) - set(names))
        spec = cls(**{k: raw[k] for k in names if k in raw})
        spec._check(where, limits or ModelLimits(None, None, None), block_size)
        return replace(spec, targets=tuple(spec.targets))

    def _check(self, where, limits: ModelLimits, block_size: int | None) -> None:
        rows = limits.vocab_rows
        # the adapter embeds its mask itself: one id past the embedding's last row is its own
        _check_int(where, "adapter.mask_token_id", self.mask_token_id, 0, rows, " (at most one past the embedding)")
        _check_int(where, "adapter.hidden_size", self.hidden_size, 1)
        if limits.hidden_size is not None and self.hidden_size != limits.hidden_size:
            raise UserError(
                f"{where}: adapter.hidden_size {self.hidden_size} is not the model's hidden size {limits.hidden_size}"
            )
        _check_int(where, "adapter.rows", self.rows, 1)
        if block_size is not None and self.rows not in (1, block_size):
            raise UserError(f"{where}: adapter.rows must be 1 or the block size {block_size}, got {self.rows}")
        _check_int(where, "adapter.rank", self.rank, 0, self.hidden_size, " (at most the hidden size)")
        alpha = self.alpha
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
            raise UserError(f"{where}: adapter.alpha must be a finite number > 0, got {alpha!r}")
        if not isinstance(self.targets, (list, tuple)) or not all(isinstance(t, str) and t for t in self.targets):
            raise UserError(f"{where}: adapter.targets must be a list of Linear names, got {self.targets!r}")
        found = self.base_fingerprint
        if found is not None and not (isinstance(found, dict) and all(isinstance(v, str) for v in found.values())):
            raise UserError(f"{where}: adapter.base_fingerprint must map dtypes to digests, got {found!r}")

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}


@dataclass
class MarsConfig:
    stage: str = "ar"  # "ar" (plain SFT) or "mars"
    block_size: int = DEFAULT_BLOCK_SIZE  # B the model was trained with (1 for AR SFT)
    mask_token: str = MASK_TOKEN
    mask_token_id: int | None = None
    ar_weight: float = 1.0
    base_model: str | None = None
    # Exact mode (adapter.py): the adapter's shape (AdapterSpec.to_dict); its weights are in
    # mars_adapter.safetensors and the model files are the original's. None: full mode, every
    # trained weight is in the model.
    adapter: dict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.adapter is not None

    def save(self, directory: str | Path) -> None:
        Path(directory, FILENAME).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, limits: ModelLimits | None = None) -> MarsConfig | None:
        """The directory's ``marslm.json`` (None: there is none), refused in one line where it is not
        a valid record, where ``limits`` (the model's) bound a field out, or where it and the
        adapter file disagree (an adapter entry without the file, or the file without an entry)."""
        path = Path(directory, FILENAME)
        has_adapter = Path(directory, ADAPTER_FILENAME).is_file()
        if not path.is_file():
            if has_adapter:
                raise UserError(f"{directory} holds {ADAPTER_FILENAME} but no {FILENAME} to describe it")
            return None
        raw = read_json(path, hint="; restore it or remove it")
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold a JSON object, got {type(raw).__name__}; restore it or remove it")
        _warn_unknown(path, FILENAME, set(raw) - set(cls.__dataclass_fields__))
        config = cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        if config.exact != has_adapter:
            if config.exact:
                raise UserError(f"{path} describes an adapter, but {ADAPTER_FILENAME} is missing beside it")
            raise UserError(f"{path} has no adapter entry, but {ADAPTER_FILENAME} is beside it; restore the entry")
        config.validate(path, limits)
        return config

    def validate(self, where: str | Path, limits: ModelLimits | None = None) -> None:
        """Every field's type; with ``limits``, the bounds the model sets (block size within its
        context, mask id within its embedding, the adapter's sizes its own)."""
        limits = limits or ModelLimits(None, None, None)
        if self.stage not in STAGES:
            raise UserError(f"{where}: stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        within = " (the model's context)" if limits.context else ""
        _check_int(where, "block_size", self.block_size, 1, limits.context, within)
        if not isinstance(self.mask_token, str) or not self.mask_token:
            raise UserError(f"{where}: mask_token must be a non-empty string, got {self.mask_token!r}")
        if self.mask_token_id is not None:
            _check_int(where, "mask_token_id", self.mask_token_id, 0, None, " (a token id)")
            rows = limits.vocab_rows
            # (an exact checkpoint's mask id is its adapter's, checked with the adapter's entry)
            if self.adapter is None and rows is not None and self.mask_token_id >= rows:
                raise UserError(
                    f"{where}: mask_token_id {self.mask_token_id}, outside the model's vocabulary (0..{rows - 1})"
                )
        ar_weight = self.ar_weight
        if not isinstance(ar_weight, (int, float)) or isinstance(ar_weight, bool) or not math.isfinite(ar_weight):
            raise UserError(f"{where}: ar_weight must be a finite number, got {ar_weight!r}")
        if self.base_model is not None and not isinstance(self.base_model, str):
            raise UserError(f"{where}: base_model must be a string, got {self.base_model!r}")
        if not isinstance(self.extra, dict):
            raise UserError(f"{where}: extra must be a JSON object, got {type(self.extra).__name__}")
        if self.adapter is not None:
            spec = AdapterSpec.from_dict(self.adapter, where, limits, self.block_size)
            if self.mask_token_id is not None and self.mask_token_id != spec.mask_token_id:
                raise UserError(
                    f"{where}: mask_token_id {self.mask_token_id} differs from the adapter's {spec.mask_token_id}"
                )


def _warn_unknown(where, what: str, unknown: set) -> None:
    """Keys marslm does not read (a newer marslm's, or a typo): named once, then ignored."""
    key = (str(where), what, tuple(sorted(unknown)))
    if unknown and key not in _warned:
        _warned.add(key)
        log.warning("%s: unknown keys in the %s, ignored: %s", where, what, ", ".join(sorted(unknown)))
