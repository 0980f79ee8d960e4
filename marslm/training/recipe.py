"""``marslm train``'s recipe for both stages, on the Hugging Face ``Trainer``: setup -> train -> save.

The recipe is deliberately thin: load a model and chat data, encode conversations (dataset.py),
collate and choose the loss (objective.py, bound once in :class:`Objective`), decide what trains
(surgery.py), and hand the loss to ``Trainer``. Everything a multi-GPU user needs (``accelerate
launch`` with DeepSpeed or FSDP, bf16, gradient accumulation, resuming, cosine schedule with
warmup) is ``Trainer``'s, untouched.

Checkpoints are plain ``save_pretrained`` directories plus ``marslm.json`` (exact mode: the
original's files, the adapter beside them). Work in progress lives in ``OUT.partial/`` (Trainer
checkpoints, for resuming); the finished model is written to a temporary directory and renamed
into place, so ``OUT`` is either complete or absent (checkpoints.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from ..adapter import adapter_of, choose_mask_id
from ..chat import end_of_turn_id, stop_token_ids
from ..data import load_conversations
from ..errors import UserError
from ..mars_json import MASK_TOKEN, MarsConfig
from ..modeling import check_model_source, check_tokenizer, count_parameters, loading_errors
from ..settings import flag_of
from .cache import check_cache_dir
from .checkpoints import (
    agreed_resume_point,
    last_loss,
    may_resume,
    nothing_left_on_failure,
    one_run_per_output,
    partial_dir_of,
    resumes_same_data,
    run_settings,
    save_atomically,
    train_from,
)
from .collate import collate, collate_packed
from .config import TrainConfig
from .dataset import cached_encoding, encode_dataset, encoding_key, generated_answers, with_teacher
from .exact import exact_mars_loss
from .objective import LossOptions, Masking, ar_loss, mars_loss
from .surgery import enable_activation_checkpointing, ensure_mask_token, saved_parameters, trainable_part

log = logging.getLogger("marslm.train")


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


def train(cfg: TrainConfig, callbacks=(), model=None, tokenizer=None) -> TrainSummary:
    """Run one training stage end to end; returns a summary. ``model``/``tokenizer`` skip loading.
    One run per output at a time; a run that fails before its first checkpoint leaves nothing."""
    started = time.time()
    cfg = cfg.with_defaults()
    resume = _check(cfg, model)
    with one_run_per_output(cfg.output), nothing_left_on_failure(partial_dir_of(cfg.output)):
        return _train(cfg, callbacks, model, tokenizer, resume, started)


def _train(cfg: TrainConfig, callbacks, model, tokenizer, resume: bool, started: float) -> TrainSummary:
    conversations = load_conversations(cfg.data, "train", n=cfg.data_n, seed=cfg.data_seed, mix=cfg.data_mix)
    # Imported only once the input is known to be good: bad input fails in a fraction of a second.
    from transformers import set_seed

    set_seed(cfg.seed)
    model, tokenizer, generated = _load(cfg, model, tokenizer)
    for line in cfg.idle_flags():  # after every refusal: an error stays one line
        log.warning("%s", line)
    parameters_before = count_parameters(model)
    stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    eos_id = end_of_turn_id(tokenizer, stop_ids)  # what block padding repeats (objective.pad_to_block)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    data_key = encoding_key(cfg, tokenizer, stop_ids, eos_id)
    resume = resumes_same_data(cfg, data_key, resume)
    data = conversations, generated
    examples, truncated, dropped = _examples(cfg, data_key, model, tokenizer, data, stop_ids, eos_id, pad_id)
    objective = objective_for(cfg, model, tokenizer, pad_id, eos_id)
    model, mask_row = trainable_part(model, cfg, objective.mask_token_id)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(model.get_base_model() if cfg.lora_rank else model)

    from .trainer import MarsTrainer

    partial_dir = partial_dir_of(cfg.output)
    trainer = MarsTrainer(
        model=model,
        args=_training_arguments(cfg, partial_dir),
        train_dataset=examples,
        data_collator=objective.collator,
        processing_class=tokenizer,
        callbacks=list(callbacks),
        loss_fn=objective.loss,
        normalization=cfg.loss_normalization,
        own_lr={mask_row: cfg.mask_lr or cfg.learning_rate} if mask_row is not None else None,
    )
    steps = train_from(trainer, agreed_resume_point(trainer, partial_dir, cfg, resume, data_key))

    adapter = adapter_of(model)
    summary = TrainSummary(
        stage=cfg.stage,
        output=cfg.output,
        examples=len(examples),
        truncated=truncated,
        dropped=dropped,
        steps=steps,
        final_loss=last_loss(trainer),
        seconds=round(time.time() - started, 1),
        parameters=saved_parameters(model),
        loss_normalization=cfg.loss_normalization,
        masked_weighting=cfg.masked_weighting,
    )
    if cfg.stage == "mars" and summary.parameters != parameters_before:
        log.warning(
            "the mask token needed a new embedding row: %d -> %d parameters", parameters_before, summary.parameters
        )
    extra = {"train": asdict(summary), "settings": run_settings(cfg), **cfg.extra}
    record = objective.record(cfg, adapter, extra=extra)
    save_atomically(trainer, record, Path(cfg.output), partial_dir, overwrite=cfg.overwrite)
    return summary


def _check(cfg: TrainConfig, model) -> bool:
    """Everything that can be refused before loading; returns whether a partial run may be resumed."""
    cfg.validate()
    check_cache_dir()
    _refuse_data_parallel()
    if cfg.attention == "flex" and not torch.cuda.is_available():
        raise UserError("--attention flex trains only on CUDA (torch has no FlexAttention backward on a CPU); use sdpa")
    resume = may_resume(cfg)
    if model is None:
        check_model_source(cfg.model)
    return resume


def _check_against_model(cfg: TrainConfig, model) -> None:
    """The settings a model bounds, refused before they size an allocation: a block within its
    positions, a top-k within its vocabulary, a LoRA rank within its hidden size."""

    def refuse(name: str, value: int, bound: int, what: str) -> None:
        if value is not None and value > bound:
            raise UserError(f"{flag_of(TrainConfig, name)} must be <= {bound:,} ({what}), got {value:,}")

    config = model.config
    rows = model.get_input_embeddings().weight.shape[0]
    positions = getattr(config, "max_position_embeddings", None)
    if cfg.stage == "mars" and positions:
        refuse("block_size", cfg.block_size, positions, "the model's positions")
    refuse("teacher_top_k", cfg.teacher_top_k, model.get_output_embeddings().weight.shape[0], "its vocabulary")
    refuse("vocab_multiple", cfg.vocab_multiple, rows, "its embedding rows")
    refuse("lora_rank", cfg.lora_rank, config.hidden_size, "its hidden size")


def _examples(cfg: TrainConfig, data_key: str, model, tokenizer, data, stop_ids, eos_id: int, pad_id: int):
    """``(examples, truncated, dropped)``: ``data``, the conversations and the distill records (None:
    train on the conversations), encoded and cached by content, with the starting model's teacher
    rows where a soft target needs them."""
    conversations, generated = data
    sources = conversations if generated is None else generated
    examples, truncated, dropped = cached_encoding(
        data_key,
        lambda: encode_dataset(tokenizer, conversations, cfg.max_length, stop_ids, eos_id, generated),
        inputs=len(sources),
        vocab_size=model.get_input_embeddings().weight.shape[0],
    )
    if truncated:
        log.warning("%d of %d conversations were truncated to --max-length %d", truncated, len(sources), cfg.max_length)
    return with_teacher(cfg, data_key, model, examples, pad_id), truncated, dropped


def _load(cfg: TrainConfig, model, tokenizer):
    """``(model, tokenizer, distill records or None)``: loaded unless given, every distill record checked
    against the vocabulary before the model loads, and the settings the model bounds checked."""
    if tokenizer is None:
        tokenizer = _load_tokenizer(cfg)
    generated = generated_answers(cfg, len(tokenizer))
    if model is None:
        model = _load_model(cfg)
    _check_against_model(cfg, model)
    return model, tokenizer, generated


def _load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    with loading_errors(cfg.model):
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    check_tokenizer(tokenizer, cfg.model)
    return tokenizer


def _load_model(cfg: TrainConfig):
    """The model to start from, in float32 (mixed precision keeps float32 master weights)."""
    from transformers import AutoModelForCausalLM

    with loading_errors(cfg.model):
        return AutoModelForCausalLM.from_pretrained(
            cfg.model, dtype=torch.float32, attn_implementation=_attn_implementation(cfg.attention)
        )


@dataclass(frozen=True)
class Objective:
    """A stage's loss and the collator that feeds it, bound together to one block size and mask
    token: the collator pads each sequence to the loss's block grid."""

    loss: Callable
    collator: Callable
    block_size: int  # 1: stage ar
    mask_token_id: int | None

    def record(self, cfg: TrainConfig, adapter, extra: dict) -> MarsConfig:
        """The checkpoint's ``marslm.json``."""
        return MarsConfig(
            stage=cfg.stage,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            ar_weight=cfg.ar_weight if cfg.stage == "mars" else 1.0,
            base_model=cfg.model,
            adapter=None if adapter is None else adapter.spec.to_dict(),
            extra=extra,
        )


def objective_for(cfg: TrainConfig, model, tokenizer, pad_id: int, eos_id: int) -> Objective:
    """The stage's :class:`Objective`; stage mars gives the model its mask token (full mode) or
    picks one the adapter embeds (exact mode)."""
    block_size = cfg.block_size if cfg.stage == "mars" else 1
    collator = partial(collate_packed if cfg.packing else collate, pad_id=pad_id, block_size=block_size, eos_id=eos_id)
    if cfg.stage == "ar":
        mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN) if MASK_TOKEN in tokenizer.get_vocab() else None
        loss = partial(ar_loss, soft_clean=cfg.soft_clean, normalization=cfg.loss_normalization)
        return Objective(loss, collator, 1, mask_id)
    masking = Masking(random_phase=cfg.random_phase, streams=cfg.masked_streams, offset_decay=cfg.offset_decay)
    if cfg.exact:
        mask_id = choose_mask_id(model, tokenizer, MASK_TOKEN)
    else:
        mask_id = ensure_mask_token(model, tokenizer, vocab_multiple=cfg.vocab_multiple)
    named_alike = ("ar_weight", "masked_weighting", "soft_clean", "soft_masked", "teacher_top_k")  # in TrainConfig
    settings = {name: getattr(cfg, name) for name in named_alike}
    options = LossOptions(block_size, mask_id, normalization=cfg.loss_normalization, masking=masking, **settings)
    loss = partial(exact_mars_loss if cfg.exact else mars_loss, options=options)
    return Objective(loss, collator, block_size, mask_id)


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
