"""Training recipes: stage 1 (AR SFT) and stage 2 (MARS), on the Hugging Face ``Trainer``.

The recipe is deliberately thin: load a model and chat data, encode conversations (chat.py),
collate (objective.py), and hand a loss function to ``Trainer``. Everything a multi-GPU user
needs (``accelerate launch`` with DeepSpeed or FSDP, bf16, gradient accumulation, resuming,
cosine schedule with warmup) is ``Trainer``'s, untouched.

Checkpoints are plain ``save_pretrained`` directories plus ``marslm.json``. Work in progress
lives in ``OUT.partial/`` (Trainer checkpoints, for resuming); the finished model is written to
a temporary directory and renamed into place, so ``OUT`` is either complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from .adapter import MaskAdapter, adapter_of, choose_mask_id, save_checkpoint
from .chat import encode_conversation, encode_generated, end_of_turn_id, stop_token_ids
from .checkpoints import checkpoint_is_complete, resume_point
from .config import (
    ATTENTIONS,
    DEFAULT_BLOCK_SIZE,
    LR_SCHEDULES,
    MASK_TOKEN,
    MASKED_WEIGHTINGS,
    NORMALIZATIONS,
    PRECISIONS,
    STAGES,
    MarsConfig,
)
from .data import check_mix, load_conversations
from .errors import UserError
from .files import read_json, write_json_atomically
from .modeling import (
    apply_lora,
    check_model_source,
    check_tokenizer,
    count_parameters,
    enable_activation_checkpointing,
    ensure_mask_token,
    freeze_for_training,
    loading_errors,
    merge_lora,
    train_embedding_rows,
)
from .objective import Masking, ar_loss, collate, collate_packed, exact_mars_loss, mars_loss
from .settings import flag_of, setting

log = logging.getLogger("marslm.train")
# Exact mode's mask rows: one per offset inside a block, or one shared by every mask.
MASK_ROWS = ("per-offset", "shared")
# Exact mode's gated-LoRA rank when --lora-rank does not say.
EXACT_RANK = 32


def _family_weights(text: str) -> dict[str, float]:
    """``"format=2,lists=3"`` -> ``{"format": 2.0, "lists": 3.0}``; the family names are checked later."""
    weights = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:  # also a part with no '=': float("") fails
            raise UserError(f"--data-mix: expected FAMILY=WEIGHT pairs such as lists=2, got {part!r}") from None
    return weights


@dataclass
class TrainConfig:
    """One training stage; the ``marslm train`` options are these fields (settings.py)."""

    stage: str = setting(help="ar: next-token SFT; mars: the MARS objective", choices=STAGES)
    model: str = setting(help="hub id or local HF model directory to start from")
    data: str = setting(help="chat JSONL ({\"messages\": [...]} per line; loss on assistant turns) or 'toy'")
    output: str = setting(help="directory for the finished checkpoint", aliases=("-o",))
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "MARS block size B")
    ar_weight: float = setting(1.0, "weight of the clean-stream (SFT) loss; 0 is the paper's ablation")
    epochs: float = setting(3.0, "training epochs")
    max_steps: int = setting(-1, "stop after this many optimizer steps (-1: run the epochs)")
    learning_rate: float = setting(2e-5, "peak learning rate", aliases=("--lr",))
    lr_schedule: str = setting("cosine", "learning-rate schedule after the warmup", choices=LR_SCHEDULES)
    warmup_ratio: float = setting(0.03, "warmup share of the steps")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    adam_epsilon: float = setting(
        1e-8,
        "AdamW epsilon: parameters whose gradient is far below it move in proportion to it instead of "
        "by the full learning rate, so gradient noise (bf16 rounding, a loss at its minimum) moves them little",
    )
    max_grad_norm: float = setting(1.0, "gradient clipping norm; 0 turns clipping off")
    batch_size: int = setting(8, "per-device batch size")
    grad_accum: int = setting(1, "gradient accumulation steps")
    max_length: int = setting(1024, "truncate longer sequences (with a warning)")
    seed: int = setting(0, "training seed")
    precision: str = setting(
        "auto",
        "bf16: mixed precision with float32 master weights (on a CPU, autocast: fast where the CPU "
        "has AMX or AVX-512 BF16); fp32; auto: bf16 with TF32 matmuls on CUDA, fp32 elsewhere",
        choices=PRECISIONS,
    )
    attention: str = setting(
        "auto",
        "attention back-end for the structured mask: flex (FlexAttention block masks: computes only "
        "the tiles the mask keeps, needs CUDA), sdpa, eager; auto: flex on CUDA, sdpa elsewhere",
        choices=ATTENTIONS,
    )
    gradient_checkpointing: bool = setting(
        False,
        "recompute each trained layer's activations in the backward instead of keeping them: "
        "far less memory for about a third more compute; frozen layers (--train-layers) are not recomputed",
    )
    overwrite: bool = setting(False, "replace an output directory that holds something")
    resume: bool = setting(True, "ignore checkpoints left by an interrupted run (default: resume from them)")
    save_steps: int = setting(500, "checkpoint every N steps (for resuming)")
    logging_steps: int = setting(10, "log the losses every N steps")
    answer_ids: bool = setting(
        True,
        "encode a `marslm distill` file's answer text again instead of training on the token ids it "
        "recorded (the default): re-encoding can split words differently from how the model generated them",
        negative="--retokenize",
    )
    cut_answers: bool = setting(
        False,
        "also train on the answers `marslm distill` cut at its token limit (DATA's .unfinished.jsonl "
        "beside it), as truncated examples that end without an end-of-turn token",
    )
    data_n: int | None = setting(None, "examples to draw from a generated source (toy)")
    data_seed: int = setting(0, "seed of a generated source's examples")
    packing: bool = setting(
        False,
        "pack several sequences into each row (position ids restart, attention stays "
        "inside each one): the same loss as padded batches without computing the padding",
    )
    data_mix: dict | None = setting(
        None,
        "toy only: relative share of task families in the training mixture, 1 "
        "unless given (e.g. lists=2 draws twice as many list items as each other "
        "family)",
        metavar="FAMILY=W[,FAMILY=W]",
        parse=_family_weights,
    )
    loss_normalization: str = setting(
        "sequence",
        "sequence (the reference's): average each sequence's token "
        "losses, then the sequences; token: average over every target "
        "token of the batch",
        choices=NORMALIZATIONS,
    )
    masked_weighting: str = setting(
        "uniform",
        "uniform, or inverse-t: weight each sequence's masked-stream loss "
        "by 1/t, t ~ U(0.001, 1), as the reference does for its 'w/o SFT "
        "loss' ablation (--ar-weight 0)",
        choices=MASKED_WEIGHTINGS,
    )
    train_layers: int | None = setting(
        None,
        "train only the top N decoder layers and the final norm; the "
        "embeddings and every lower layer stay fixed, so the backward pass "
        "stops at the lowest trained layer",
        metavar="N",
    )
    freeze_embeddings: bool = setting(
        False, "keep the embedding matrix fixed (with tied embeddings, the output projection too)"
    )
    mask_only: bool = setting(
        False,
        "train nothing but the mask token's embedding row: the clean (AR) path stays the original "
        "model exactly, so tau 1 and lossless decoding give its output by construction",
    )
    mask_lr: float | None = setting(
        None,
        "train the mask token's embedding row with this learning rate while the embeddings are "
        "frozen (--train-layers, --freeze-embeddings, --lora-rank, --mask-only; the default there: frozen, "
        "except under --mask-only, where it is --lr)",
        metavar="LR",
    )
    lora_rank: int | None = setting(
        None,
        "train LoRA adapters of this rank (peft) on the linear layers of the trained layers instead "
        "of their weights; merged into the weights at save, so the checkpoint stays a plain HF model",
        metavar="R",
    )
    lora_alpha: float | None = setting(None, "LoRA scaling alpha (default: 2x the rank)")
    exact: bool = setting(
        False,
        "exact mode (stage mars): the model stays frozen and an adapter trains that acts only where the "
        "input is the mask token (mask embedding rows, and a LoRA on every decoder Linear gated per "
        f"position; --lora-rank sets its rank, {EXACT_RANK} by default, 0 for the mask rows "
        "alone). The checkpoint is the original's files plus the adapter: its one-token outputs are the "
        "original's by construction, and the clean stream costs no backward pass",
    )
    mask_rows: str = setting(
        "per-offset",
        "exact mode: one mask embedding row per offset inside a block (per-offset), or one for all (shared)",
        choices=MASK_ROWS,
    )
    random_phase: bool = setting(
        False,
        "start each sequence's blocks at a random offset, drawn at every step, so that over the epochs each "
        "token is trained at every offset of a block (stage mars)",
    )
    masked_streams: int = setting(
        1,
        "noisy copies of each sequence per row, at distinct block phases: B copies train every token at "
        "every offset in one pass, for about that many times the masked stream's cost (stage mars)",
    )
    offset_decay: float = setting(
        1.0,
        "a mask's loss weighs DECAY ** (its offset inside the block), so the near offsets, which decoding "
        "accepts first, count most; 1 weighs them alike (stage mars)",
        metavar="DECAY",
    )
    soft_clean: float = setting(
        0.0,
        "share of the original model's own next-token distribution in the clean stream's targets, "
        "the rest the data's token: 1 is a KL to the original, an anchor that pulls drift back "
        "instead of sharpening (its top-k is kept in one pass before training: --teacher-top-k)",
        metavar="S",
    )
    soft_masked: float = setting(
        0.0,
        "share of the original's distribution in the masks' targets, beside the data's token (stage mars)",
        metavar="S",
    )
    teacher_top_k: int = setting(
        16, "how many of the original's most likely tokens each soft target keeps (the rest as one bucket)"
    )
    vocab_multiple: int = setting(
        64,
        "when the mask token needs a new embedding row, grow the vocabulary to a multiple of this "
        "(aligned GEMMs, divisible for tensor parallelism); 1 grows by one row",
    )
    progress: bool = setting(True, "no progress bar", negative="--quiet")
    extra: dict = setting({}, cli=False)

    def validate(self) -> None:
        """Every setting checked before anything is loaded or written (the CLI relies on it)."""

        def flag(name):
            return flag_of(TrainConfig, name)

        if self.stage not in STAGES:
            raise UserError(f"stage must be one of {STAGES}, got {self.stage!r}")
        _check_range(flag("learning_rate"), self.learning_rate, low=0, low_open=True)
        _check_range(flag("ar_weight"), self.ar_weight, low=0)
        _check_range(flag("warmup_ratio"), self.warmup_ratio, low=0, high=1, high_open=True)
        _check_range(flag("weight_decay"), self.weight_decay, low=0)
        _check_range(flag("adam_epsilon"), self.adam_epsilon, low=0, low_open=True)
        _check_range(flag("epochs"), self.epochs)
        _check_range(flag("max_grad_norm"), self.max_grad_norm, low=0)
        _check_range(flag("soft_clean"), self.soft_clean, low=0, high=1)
        _check_range(flag("soft_masked"), self.soft_masked, low=0, high=1)
        if self.soft_masked and self.stage != "mars":
            raise UserError(f"{flag('soft_masked')} is for stage mars (stage ar has no masks)")
        if self.mask_lr is not None:
            _check_range(flag("mask_lr"), self.mask_lr, low=0, low_open=True)
            if not (self.mask_only or self.train_layers or self.freeze_embeddings or self.lora_rank or self.exact):
                raise UserError(
                    f"{flag('mask_lr')} needs frozen embeddings ({flag('train_layers')}, {flag('freeze_embeddings')}, "
                    f"{flag('lora_rank')} or {flag('mask_only')}): otherwise the mask row trains "
                    f"with the embeddings at {flag('learning_rate')}"
                )
        if self.mask_only and (self.train_layers or self.lora_rank or self.freeze_embeddings):
            raise UserError(
                f"{flag('mask_only')} trains only the mask row: it takes no {flag('train_layers')}, "
                f"{flag('lora_rank')} or {flag('freeze_embeddings')}"
            )
        if self.mask_only and self.stage != "mars":
            raise UserError(f"{flag('mask_only')} is for stage mars (stage ar reads no mask token)")
        if self.lora_alpha is not None:
            _check_range(flag("lora_alpha"), self.lora_alpha, low=0, low_open=True)
        self._check_masking(flag)
        if self.exact:
            self._check_exact(flag)
        if self.attention == "flex" and not torch.cuda.is_available():
            raise UserError(
                f"{flag('attention')} flex trains only on CUDA (torch has no FlexAttention backward on a CPU); use sdpa"
            )
        for name in (
            "block_size",
            "batch_size",
            "grad_accum",
            "save_steps",
            "logging_steps",
            "data_n",
            "train_layers",
            "vocab_multiple",
            "teacher_top_k",
            "masked_streams",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{flag(name)} must be >= 1, got {value}")
        for name, allowed in (
            ("loss_normalization", NORMALIZATIONS),
            ("masked_weighting", MASKED_WEIGHTINGS),
            ("lr_schedule", LR_SCHEDULES),
            ("precision", PRECISIONS),
            ("attention", ATTENTIONS),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(f"{flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0 <= self.seed < 2**32:  # the range numpy takes, and set_seed passes it on
            raise UserError(f"{flag('seed')} must be in 0..{2**32 - 1}, got {self.seed}")
        if self.max_length < 2:
            raise UserError(f"{flag('max_length')} must be >= 2, got {self.max_length}")
        check_mix(self.data, self.data_mix)
        if self.epochs <= 0 and self.max_steps <= 0:
            raise UserError(f"give a positive {flag('epochs')} or {flag('max_steps')}")
        out = Path(self.output)
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not self.overwrite:
            raise UserError(f"output directory {out} already holds something; pass --overwrite to replace it")

    def _check_masking(self, flag) -> None:
        _check_range(flag("offset_decay"), self.offset_decay, low=0, high=1)
        if self.lora_rank is not None and self.lora_rank < (0 if self.exact else 1):
            raise UserError(f"{flag('lora_rank')} must be >= {0 if self.exact else 1}, got {self.lora_rank}")
        if self.mask_rows not in MASK_ROWS:
            raise UserError(f"{flag('mask_rows')} must be one of {', '.join(MASK_ROWS)}, got {self.mask_rows!r}")
        changed = [
            name
            for name in ("random_phase", "masked_streams", "offset_decay", "exact")
            if getattr(self, name) != TrainConfig.__dataclass_fields__[name].default
        ]
        if changed and self.stage != "mars":
            raise UserError(f"{flag(changed[0])} is for stage mars (stage ar has no masks)")

    def _check_exact(self, flag) -> None:
        """Exact mode trains the adapter alone: nothing that would train or anchor the model's weights."""
        for name in ("mask_only", "train_layers", "freeze_embeddings", "soft_clean", "gradient_checkpointing"):
            if getattr(self, name):
                raise UserError(
                    f"{flag('exact')} keeps the model frozen and trains only its adapter: drop {flag(name)}"
                    + (" (the masked stream alone keeps activations)" if name == "gradient_checkpointing" else "")
                )


def _check_range(
    flag: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """A finite number within [low, high] (an open end excludes the bound)."""
    if not math.isfinite(value):
        raise UserError(f"{flag} must be a finite number, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise UserError(f"{flag} must be {'>' if low_open else '>='} {low:g}, got {value:g}")
    if high is not None and (value > high or (high_open and value == high)):
        raise UserError(f"{flag} must be {'<' if high_open else '<='} {high:g}, got {value:g}")


def _use_bf16(precision: str) -> bool:
    """Whether to train in bf16 mixed precision; on CUDA, float32 matmuls may use TF32 either way."""
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return precision == "bf16" or (precision == "auto" and on_cuda)


def _attn_implementation(attention: str) -> str:
    """transformers' name of the attention back-end (``auto``: FlexAttention on CUDA where this
    torch has it, else sdpa)."""
    if attention == "auto":
        attention = "flex" if torch.cuda.is_available() and _has_flex_attention() else "sdpa"
    elif attention == "flex" and not _has_flex_attention():
        raise UserError(f"--attention flex needs torch >= 2.5 (this is {torch.__version__}); use sdpa")
    return "flex_attention" if attention == "flex" else attention


def _has_flex_attention() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True


def _refuse_data_parallel() -> None:
    """Trainer turns one process on several GPUs into ``DataParallel``: a single process driving
    every GPU, slower than one GPU for a model this size and not what anyone launching it meant."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        raise UserError(
            f"{gpus} GPUs are visible to one process: run `accelerate launch --num_processes {gpus} -m marslm.cli "
            "train ...` (one process per GPU), or pick one GPU with CUDA_VISIBLE_DEVICES=0"
        )


def _trainable_part(model, cfg: TrainConfig, mask_id: int | None):
    """Freeze what the config keeps fixed and wrap LoRA adapters; returns ``(model, mask row matrix)``,
    the second the embedding matrix when only the mask token's row of it trains (else None)."""
    mask_row = None
    if cfg.exact:
        model.requires_grad_(False)
        rank = EXACT_RANK if cfg.lora_rank is None else cfg.lora_rank
        rows = cfg.block_size if cfg.mask_rows == "per-offset" else 1
        adapter = MaskAdapter.for_model(model, mask_id, rank=rank, rows=rows, alpha=cfg.lora_alpha)
        adapter.attach(model)
        mask_row = adapter.rows if cfg.mask_lr is not None else None
        log.warning(
            "exact mode: the model is frozen; training an adapter of %s parameters (%d mask rows, gated LoRA rank %d)",
            f"{count_parameters(adapter):,}",
            rows,
            rank,
        )
        return model, mask_row
    if cfg.mask_only:
        model.requires_grad_(False)
        mask_row = train_embedding_rows(model, [mask_id])
        what = "the mask token's embedding row"
    else:
        freeze_for_training(model, cfg.train_layers, cfg.freeze_embeddings)
        what = f"top {cfg.train_layers} layers" if cfg.train_layers else "all layers"
        if cfg.freeze_embeddings and not cfg.train_layers:
            what += ", embeddings frozen"
        if cfg.lora_rank:
            model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.train_layers)
            what = f"LoRA rank {cfg.lora_rank} on the {what}"
        if cfg.mask_lr is not None and mask_id is not None:
            mask_row = train_embedding_rows(model, [mask_id])
            what += f", and the mask token's embedding row at lr {cfg.mask_lr:g}"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad and p is not mask_row)
    trainable += 0 if mask_row is None else mask_row.shape[1]
    if what != "all layers":
        log.warning("training %s of %s parameters (%s)", f"{trainable:,}", f"{count_parameters(model):,}", what)
    return model, mask_row


@dataclass
class TrainSummary:
    stage: str
    output: str
    examples: int
    truncated: int
    dropped: int
    steps: int
    final_loss: float | None
    seconds: float
    parameters: int
    loss_normalization: str = "sequence"
    masked_weighting: str = "uniform"


RUN_SETTINGS = "marslm-run.json"
# Fields that change nothing a run computes: a rerun may change them and still resume.
_NOT_THE_RUN = ("output", "overwrite", "resume", "progress", "save_steps", "logging_steps", "extra")


def partial_dir_of(output: str) -> Path:
    return Path(str(Path(output)) + ".partial")


def run_settings(cfg: TrainConfig) -> dict:
    """The settings that define a run, as JSON would give them back."""
    return json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k not in _NOT_THE_RUN}))


def may_resume(cfg: TrainConfig) -> bool:
    """Whether the run resumes from what an interrupted run left in ``OUT.partial/`` (read-only,
    so it runs before anything loads). Checkpoints are only resumed by the run they belong to
    (its settings, recorded there by :func:`record_run`): a rerun with other data, learning rate
    or steps is refused, and --overwrite discards them as --no-resume does."""
    partial_dir = partial_dir_of(cfg.output)
    if not cfg.resume or not any(checkpoint_is_complete(p) for p in partial_dir.glob("checkpoint-*")):
        return cfg.resume
    way_out = "pass --no-resume or --overwrite to discard its checkpoints and start afresh"
    path = partial_dir / RUN_SETTINGS
    recorded = read_json(path, hint=f"; {way_out}") if path.is_file() else None
    now = run_settings(cfg)
    if recorded == now:
        return True
    if cfg.overwrite:
        return False
    if not isinstance(recorded, dict):
        raise UserError(f"{partial_dir} holds checkpoints of a run whose settings were not recorded; {way_out}")
    name = next(k for k in sorted(set(recorded) | set(now)) if recorded.get(k) != now.get(k))
    raise UserError(
        f"{partial_dir} holds checkpoints of a run with {flag_of(TrainConfig, name)} {recorded.get(name)!r}, "
        f"not {now.get(name)!r}: rerun with its settings to resume it, or {way_out}"
    )


def record_run(partial_dir: Path, cfg: TrainConfig) -> None:
    write_json_atomically(partial_dir / RUN_SETTINGS, run_settings(cfg))


def generated_answers(cfg: TrainConfig) -> list[dict] | None:
    """The distill records of DATA (and of its cut answers with ``cut_answers``) when DATA is a
    ``marslm distill`` file and ``answer_ids`` is on; None: train on the conversations' text."""
    from .distill import read_answers, unfinished_path

    path = Path(cfg.data)
    if not cfg.answer_ids or not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        first = f.readline()
    try:
        if "answer_ids" not in json.loads(first):
            return None
    except (ValueError, TypeError):
        return None  # not a distill file: the chat reader says what is wrong with it
    records = list(read_answers(path, include_unfinished=False).values())
    if cfg.cut_answers:
        records += list(read_answers(unfinished_path(path), include_unfinished=False).values())
    return records[: cfg.data_n] if cfg.data_n else records


def encode_dataset(tokenizer, conversations, max_length: int, stop_ids, eos_id: int, generated=None):
    """Encode every conversation (or generated answer); return (examples, truncated count, dropped count)."""
    examples, truncated, dropped = [], 0, 0
    for item in generated if generated is not None else conversations:
        if generated is not None:
            enc = encode_generated(
                tokenizer, item["messages"], item["answer_ids"], item.get("finished", True), eos_id, max_length
            )
        else:
            enc = encode_conversation(tokenizer, item, max_length=max_length, stop_ids=stop_ids)
        truncated += enc.truncated
        if all(label < 0 for label in enc.labels[1:]):
            dropped += 1  # truncation left no target to learn
            continue
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    if not examples:
        raise UserError("no trainable examples: every conversation lost its answer to --max-length")
    return examples, truncated, dropped


def cache_dir() -> Path:
    """Where tokenised datasets are kept: ``$MARSLM_CACHE``, else ``~/.cache/marslm``."""
    return Path(os.environ.get("MARSLM_CACHE") or Path.home() / ".cache" / "marslm") / "tokenized"


def _encoding_key(cfg: TrainConfig, tokenizer) -> str:
    """What the encoded examples depend on: the data's bytes, the tokenizer and the settings that
    choose and cut examples. Two runs with the same key get the same examples."""
    digest = hashlib.sha256()
    for path in (
        Path(cfg.data),
        Path(cfg.data).with_name(Path(cfg.data).name.removesuffix(".jsonl") + ".unfinished.jsonl"),
    ):
        if path.is_file():
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    settings = [cfg.data if not Path(cfg.data).is_file() else "", cfg.data_n, cfg.data_seed, cfg.data_mix]
    settings += [
        cfg.max_length,
        cfg.answer_ids,
        cfg.cut_answers,
        tokenizer.chat_template,
        sorted(tokenizer.get_vocab().items()),
    ]
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:24]


def cached(key: str, compute):
    """``compute()``, kept under ``cache_dir()/key.pt`` and read from there the next time.

    Under ``accelerate launch`` the main process computes first and writes the cache; the other
    ranks then read it instead of each computing it again.
    """
    from accelerate import PartialState

    path = cache_dir() / f"{key}.pt"
    with PartialState().main_process_first():
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except Exception:  # noqa: BLE001 - an unreadable cache is computed again and replaced
                log.warning("ignoring an unreadable cache %s", path)
        value = compute()
        if PartialState().is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(value, tmp)
            os.replace(tmp, path)
    return value


def cached_encoding(data_key: str, encode):
    """``encode()``'s ``(examples, truncated, dropped)``, computed once per :func:`_encoding_key`."""

    def compute():
        examples, truncated, dropped = encode()
        return {"examples": examples, "truncated": truncated, "dropped": dropped}

    value = cached(data_key, compute)
    return value["examples"], value["truncated"], value["dropped"]


def _model_identity(model_name: str) -> list:
    """What tells one starting model from another: the hub id, or a directory's weight files."""
    path = Path(model_name)
    if not path.is_dir():
        return [model_name]
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    return [str(path.resolve())] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]


def with_teacher(cfg: TrainConfig, data_key: str, model, examples: list[dict], pad_id: int) -> list[dict]:
    """The examples with the starting model's top-k at every label (teacher.py), when a soft
    target asks for it; computed once per encoded dataset (``data_key``), model and k."""
    if cfg.exact or not (cfg.soft_clean or cfg.soft_masked):
        return examples  # exact mode's teacher is its own clean stream (objective.exact_mars_loss)
    from accelerate import PartialState

    from .teacher import teacher_top_k

    key = json.dumps([data_key, cfg.teacher_top_k, _model_identity(cfg.model)], default=str)
    digest = "teacher-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    model.to(PartialState().device)
    tops = cached(digest, lambda: teacher_top_k(model, examples, cfg.teacher_top_k, pad_id, cfg.progress))
    return [ex | top for ex, top in zip(examples, tops)]


def train(cfg: TrainConfig, callbacks=(), model=None, tokenizer=None) -> TrainSummary:
    """Run one training stage end to end; returns a summary. ``model``/``tokenizer`` skip loading."""
    started = time.time()
    cfg.validate()
    _refuse_data_parallel()
    resume = may_resume(cfg)
    if model is None:
        check_model_source(cfg.model)
    conversations = load_conversations(cfg.data, "train", n=cfg.data_n, seed=cfg.data_seed, mix=cfg.data_mix)
    # Imported only once the input is known to be good: bad input fails in a fraction of a second.
    from transformers import set_seed

    set_seed(cfg.seed)
    if model is None:
        model, tokenizer = _load(cfg)
    parameters_before = count_parameters(model)
    stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    eos_id = end_of_turn_id(tokenizer, stop_ids)  # what block padding repeats (objective.pad_to_block)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id

    data_key = _encoding_key(cfg, tokenizer)  # hashes the data file and the vocabulary: once
    examples, truncated, dropped = cached_encoding(
        data_key,
        lambda: encode_dataset(tokenizer, conversations, cfg.max_length, stop_ids, eos_id, generated_answers(cfg)),
    )
    if truncated:
        log.warning(
            "%d of %d conversations were truncated to --max-length %d", truncated, len(conversations), cfg.max_length
        )
    examples = with_teacher(cfg, data_key, model, examples, pad_id)  # the model as it starts
    loss_fn, collator, mask_id, block_size = _objective(cfg, model, tokenizer, pad_id, eos_id)
    model, mask_row = _trainable_part(model, cfg, mask_id)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(model.get_base_model() if cfg.lora_rank else model)

    from .trainer import MarsTrainer

    partial_dir = partial_dir_of(cfg.output)
    trainer = MarsTrainer(
        model=model,
        args=_training_arguments(cfg, partial_dir),
        train_dataset=examples,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=list(callbacks),
        loss_fn=loss_fn,
        normalization=cfg.loss_normalization,
        own_lr={mask_row: cfg.mask_lr or cfg.learning_rate} if mask_row is not None else None,
    )
    steps = _train_from(trainer, _resume_point(trainer, partial_dir, cfg, resume))

    summary = TrainSummary(
        stage=cfg.stage,
        output=cfg.output,
        examples=len(examples),
        truncated=truncated,
        dropped=dropped,
        steps=steps,
        final_loss=_last_loss(trainer),
        seconds=round(time.time() - started, 1),
        parameters=count_parameters(model),
        loss_normalization=cfg.loss_normalization,
        masked_weighting=cfg.masked_weighting,
    )
    adapter = adapter_of(model)
    if adapter is not None:
        summary.parameters -= count_parameters(adapter)
    if cfg.stage == "mars" and summary.parameters != parameters_before:
        log.warning(
            "the mask token needed a new embedding row: %d -> %d parameters", parameters_before, summary.parameters
        )
    mars_config = MarsConfig(
        stage=cfg.stage,
        block_size=block_size,
        mask_token_id=mask_id,
        ar_weight=cfg.ar_weight if cfg.stage == "mars" else 1.0,
        base_model=cfg.model,
        adapter=None if adapter is None else adapter.spec.to_dict(),
        extra={"train": asdict(summary), **cfg.extra},
    )
    _save_atomically(trainer, mars_config, Path(cfg.output), partial_dir, overwrite=cfg.overwrite)
    return summary


def _load(cfg: TrainConfig):
    """``(model, tokenizer)`` to start from, in float32 (mixed precision keeps float32 master weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with loading_errors(cfg.model):
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model, dtype=torch.float32, attn_implementation=_attn_implementation(cfg.attention)
        )
    check_tokenizer(tokenizer, cfg.model)
    return model, tokenizer


def _objective(cfg: TrainConfig, model, tokenizer, pad_id: int, eos_id: int):
    """``(loss_fn, collator, mask_id, block_size)`` of the stage; stage mars adds the mask token."""
    collate_fn = collate_packed if cfg.packing else collate
    soft = {"soft_clean": cfg.soft_clean, "normalization": cfg.loss_normalization}
    masking = Masking(random_phase=cfg.random_phase, streams=cfg.masked_streams, offset_decay=cfg.offset_decay)
    if cfg.stage == "mars" and cfg.exact:
        mask_id = choose_mask_id(model, tokenizer, MASK_TOKEN)
        loss_fn = partial(
            exact_mars_loss,
            block_size=cfg.block_size,
            mask_token_id=mask_id,
            normalization=cfg.loss_normalization,
            masked_weighting=cfg.masked_weighting,
            soft_masked=cfg.soft_masked,
            teacher_top_k=cfg.teacher_top_k,
            masking=masking,
        )
        collator = partial(collate_fn, pad_id=pad_id, block_size=cfg.block_size, eos_id=eos_id)
        return loss_fn, collator, mask_id, cfg.block_size
    if cfg.stage == "mars":
        mask_id = ensure_mask_token(model, tokenizer, vocab_multiple=cfg.vocab_multiple)
        loss_fn = partial(
            mars_loss,
            block_size=cfg.block_size,
            mask_token_id=mask_id,
            ar_weight=cfg.ar_weight,
            masked_weighting=cfg.masked_weighting,
            soft_masked=cfg.soft_masked,
            masking=masking,
            **soft,
        )
        collator = partial(collate_fn, pad_id=pad_id, block_size=cfg.block_size, eos_id=eos_id)
        return loss_fn, collator, mask_id, cfg.block_size
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN) if MASK_TOKEN in tokenizer.get_vocab() else None
    return partial(ar_loss, **soft), partial(collate_fn, pad_id=pad_id), mask_id, 1


def _training_arguments(cfg: TrainConfig, partial_dir: Path):
    from transformers import TrainingArguments

    bf16 = _use_bf16(cfg.precision)
    return TrainingArguments(
        output_dir=str(partial_dir),
        num_train_epochs=cfg.epochs if cfg.epochs > 0 else 1.0,
        max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_schedule,
        warmup_steps=cfg.warmup_ratio,
        weight_decay=cfg.weight_decay,
        adam_epsilon=cfg.adam_epsilon,
        max_grad_norm=cfg.max_grad_norm,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        seed=cfg.seed,
        data_seed=cfg.seed,
        bf16=bf16,
        # bf16 without a GPU is CPU autocast, which Trainer only allows when told the CPU is meant
        use_cpu=bf16 and not torch.cuda.is_available(),
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        logging_steps=cfg.logging_steps,
        report_to=[],
        remove_unused_columns=False,
        disable_tqdm=not cfg.progress,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def _resume_point(trainer, partial_dir: Path, cfg: TrainConfig, resume: bool) -> Path | None:
    """The checkpoint to continue from (None: from the start), agreed by every process."""
    resume_from = resume_point(partial_dir, resume) if trainer.is_world_process_zero() else None
    if trainer.is_world_process_zero():
        record_run(partial_dir, cfg)
    trainer.accelerator.wait_for_everyone()  # rank 0 has cleaned up before any rank looks
    if not trainer.is_world_process_zero():
        resume_from = resume_point(partial_dir, True)  # read-only now: nothing incomplete is left
    if resume_from is not None:
        log.warning("resuming from %s", resume_from)
    return resume_from


def _train_from(trainer, checkpoint: Path | None) -> int:
    """``trainer.train()`` from ``checkpoint``; returns the global step reached.

    A checkpoint that already holds the last step (the run was killed while writing its final
    directory) is loaded, not trained from: Trainer checks ``max_steps`` only after a step, so it
    would take one step more than asked."""
    if checkpoint is not None and trainer.args.max_steps > 0:
        from transformers import TrainerState

        state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        if state.global_step >= trainer.args.max_steps:
            trainer._load_from_checkpoint(str(checkpoint))
            trainer.state = state
            return state.global_step
    return trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None).global_step


def _last_loss(trainer) -> float | None:
    """The last logged loss, or the run's mean loss when it ended before the first log."""
    history = trainer.state.log_history
    losses = [e["loss"] for e in history if "loss" in e] or [e["train_loss"] for e in history if "train_loss" in e]
    return float(losses[-1]) if losses else None


def _save_atomically(trainer, mars_config: MarsConfig, output: Path, partial_dir: Path, overwrite: bool) -> None:
    """Write the final model next to ``output`` and rename it into place (process 0 only)."""
    from .trainer import require_finite_parameters

    staging = partial_dir / "final"
    require_finite_parameters(trainer.model, trainer.state.global_step)
    model = merge_lora(trainer.model)
    if adapter_of(model) is not None:  # exact mode: the original's files, the adapter beside them
        if trainer.is_world_process_zero():
            save_checkpoint(model, trainer.processing_class, str(mars_config.base_model), staging)
    elif model is trainer.model:
        trainer.save_model(str(staging))  # gathers sharded (FSDP/DeepSpeed) weights
    elif trainer.is_world_process_zero():  # LoRA: the merged weights, as a plain checkpoint
        model.save_pretrained(str(staging))
        trainer.processing_class.save_pretrained(str(staging))
    if not trainer.is_world_process_zero():
        return
    if adapter_of(model) is None:
        model.generation_config.save_pretrained(str(staging))
    mars_config.save(staging)
    (staging / "training_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    if output.exists():
        if not overwrite and any(output.iterdir()):
            raise UserError(f"output directory {output} appeared during training; the model is in {staging}")
        old = output.with_name(output.name + ".old")
        os.replace(output, old)
        os.replace(staging, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, output)
    shutil.rmtree(partial_dir, ignore_errors=True)
