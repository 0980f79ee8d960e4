"""``TrainConfig``: one training stage's settings, which are ``marslm train``'s options (settings.py).

Checked once, by :meth:`TrainConfig.validate`, before anything is loaded or written (and
:meth:`TrainConfig.idle_flags` names what the other settings make do nothing). Torch-free,
so the CLI builds its parser and refuses a bad command line without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..data import TOY, check_mix
from ..errors import UserError
from ..files import output_directory
from ..mars_json import DEFAULT_BLOCK_SIZE, STAGES
from ..settings import check_count, check_range, flag_of, setting, strings

# Learning-rate schedules: Trainer's names for those that need nothing beyond the warmup and the
# step count.
LR_SCHEDULES = ("cosine", "linear", "constant_with_warmup")
# Loss normalisations and masked-stream weightings (objective.py).
NORMALIZATIONS = ("sequence", "token")
MASKED_WEIGHTINGS = ("uniform", "inverse-t")
# Training precision (auto: bf16 on CUDA, float32 elsewhere) and attention back-ends (auto: flex on CUDA).
PRECISIONS = ("auto", "bf16", "fp32")
ATTENTIONS = ("auto", "sdpa", "eager", "flex")
# Settings that count something: at least 1 where given.
COUNTS = (
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
)
# Exact mode's mask rows: one per offset inside a block, or one shared by every mask.
MASK_ROWS = ("per-offset", "shared")
# Exact mode's gated-LoRA rank when --lora-rank does not say.
EXACT_RANK = 32
# LoRA scales its update by alpha / rank: far past any rank a model has, that scale turns the first
# gradients into infinities (a NaN loss at step 1), not into a setting worth training
MAX_LORA_ALPHA = 2**16
# What stage ar has no use for: it trains no masks, so no blocks and no masked stream.
MARS_ONLY = ("block_size", "ar_weight", "masked_weighting", "vocab_multiple")


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
    lora_modules: list[str] | None = setting(
        None,
        "the decoder Linears a LoRA adapts, by their own names, comma-separated (e.g. q_proj,k_proj,v_proj,"
        "o_proj; default: every one). In exact mode each one adds small matrix products to every decoding "
        "step that reads masks",
        parse=strings,
        metavar="NAMES",
    )
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
    soft_clean: float | None = setting(
        None,
        "share of the original model's own next-token distribution in the clean stream's targets, "
        "the rest the data's token: 1 is a KL to the original, an anchor that pulls drift back "
        "instead of sharpening (its top-k is kept in one pass before training: --teacher-top-k). "
        "Default: 1 where stage mars trains the model's weights on a `marslm distill` file (the "
        "model's own answers), else 0",
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
        self._check_numbers(flag)
        self._check_choices(flag)
        self._check_what_trains(flag)
        self._check_masking(flag)
        if self.exact:
            self._check_exact(flag)
        check_mix(self.data, self.data_mix)
        out = output_directory(self.output, flag("output"))
        if out.resolve() == Path.cwd() or out.resolve() in Path.cwd().parents:
            here = "holds the working directory"
            raise UserError(f"{flag('output')} {out} {here}; give the checkpoint a directory of its own")
        if out.exists() and any(out.iterdir()) and not self.overwrite:
            raise UserError(f"output directory {out} already holds something; pass --overwrite to replace it")

    def _check_numbers(self, flag) -> None:
        check_range(flag("learning_rate"), self.learning_rate, low=0, low_open=True)
        check_range(flag("ar_weight"), self.ar_weight, low=0)
        check_range(flag("warmup_ratio"), self.warmup_ratio, low=0, high=1, high_open=True)
        check_range(flag("weight_decay"), self.weight_decay, low=0)
        check_range(flag("adam_epsilon"), self.adam_epsilon, low=0, low_open=True)
        check_range(flag("epochs"), self.epochs, low=0)
        check_range(flag("max_grad_norm"), self.max_grad_norm, low=0)
        if self.soft_clean is not None:
            check_range(flag("soft_clean"), self.soft_clean, low=0, high=1)
        check_range(flag("soft_masked"), self.soft_masked, low=0, high=1)
        for name in COUNTS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{flag(name)} must be >= 1, got {value}")
        if not 0 <= self.seed < 2**32:  # the range numpy takes, and set_seed passes it on
            raise UserError(f"{flag('seed')} must be in 0..{2**32 - 1}, got {self.seed}")
        if self.max_length < 2:
            raise UserError(f"{flag('max_length')} must be >= 2, got {self.max_length}")
        if self.max_steps < 1 and self.max_steps != -1:
            raise UserError(f"{flag('max_steps')} must be >= 1, or -1 to run the epochs; got {self.max_steps}")
        if self.epochs <= 0 and self.max_steps <= 0:
            raise UserError(f"give a positive {flag('epochs')} or {flag('max_steps')}")
        if self.data == TOY and self.data_n is not None:
            check_count(flag("data_n"), self.data_n)
        if self.masked_streams > self.block_size:
            raise UserError(
                f"{flag('masked_streams')} must be <= {flag('block_size')} {self.block_size} (one copy per phase of "
                f"a block), got {self.masked_streams}"
            )

    def _check_choices(self, flag) -> None:
        for name, allowed in (
            ("loss_normalization", NORMALIZATIONS),
            ("masked_weighting", MASKED_WEIGHTINGS),
            ("lr_schedule", LR_SCHEDULES),
            ("precision", PRECISIONS),
            ("attention", ATTENTIONS),
            ("mask_rows", MASK_ROWS),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(f"{flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def _check_what_trains(self, flag) -> None:
        if self.soft_masked and self.stage != "mars":
            raise UserError(f"{flag('soft_masked')} is for stage mars (stage ar has no masks)")
        if self.mask_lr is not None:
            check_range(flag("mask_lr"), self.mask_lr, low=0, low_open=True)
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
            check_range(flag("lora_alpha"), self.lora_alpha, low=0, high=MAX_LORA_ALPHA, low_open=True)
        if self.lora_modules is not None and not (self.lora_modules and all(self.lora_modules)):
            raise UserError(f"{flag('lora_modules')} must name at least one Linear, got {self.lora_modules!r}")

    def _check_masking(self, flag) -> None:
        check_range(flag("offset_decay"), self.offset_decay, low=0, high=1)
        if self.lora_rank is not None and self.lora_rank < (0 if self.exact else 1):
            raise UserError(f"{flag('lora_rank')} must be >= {0 if self.exact else 1}, got {self.lora_rank}")
        masking = ("random_phase", "masked_streams", "offset_decay", "exact", *MARS_ONLY)
        changed = [name for name in masking if self._given(name)]
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

    def with_defaults(self) -> TrainConfig:
        """The settings whose default depends on the others (and on the data) made definite: call
        once, after :meth:`validate`, and train from the result."""
        if self.soft_clean is not None:
            return self
        return replace(self, soft_clean=1.0 if self._anchors_by_default() else 0.0)

    def _anchors_by_default(self) -> bool:
        # On the model's own answers the data's token and the model's distribution agree at the
        # argmax, so the anchor costs no learning and keeps the model closer (docs/results.md,
        # section 7). Exact mode and the mask row alone leave the clean stream's logits unchanged.
        from ..data.distilled import is_distill_file

        trains_weights = not (self.exact or self.mask_only)
        return self.stage == "mars" and trains_weights and is_distill_file(self.data)

    def _given(self, name: str) -> bool:
        """Whether a setting differs from its default: the CLI fills in every default, so a flag
        left at its default is indistinguishable from one not given, and does nothing either way."""
        return getattr(self, name) != TrainConfig.__dataclass_fields__[name].default

    def idle_flags(self) -> list[str]:
        """One line for each setting given that the others make do nothing: warnings, printed once
        every refusal has had its say (an error stays one line)."""
        from ..data.distilled import is_distill_file, unfinished_path

        def flag(name):
            return flag_of(TrainConfig, name)

        idle = []
        for name in ("lora_alpha", "lora_modules"):
            if self._given(name) and not (self.lora_rank or (self.exact and self.lora_rank is None)):
                idle.append(f"{flag(name)} does nothing without a {flag('lora_rank')} above 0")
        if self._given("teacher_top_k") and not (self.soft_clean or self.soft_masked):
            idle.append(f"{flag('teacher_top_k')} does nothing without {flag('soft_clean')} or {flag('soft_masked')}")
        if self.freeze_embeddings and self.train_layers:
            idle.append(f"{flag('freeze_embeddings')} does nothing with {flag('train_layers')}, which freezes them too")
        if self._given("mask_rows") and not self.exact:
            idle.append(f"{flag('mask_rows')} does nothing without {flag('exact')}")
        if self.exact:
            idle += [
                f"{flag(name)} does nothing with {flag('exact')} (the model is frozen; its vocabulary does not grow)"
                for name in ("ar_weight", "vocab_multiple")
                if self._given(name)
            ]
        distill = is_distill_file(self.data)
        if self._given("data_seed") and self.data != TOY:
            idle.append(f"{flag('data_seed')} does nothing with a data file (it draws a generated source's examples)")
        if not self.answer_ids and not distill:
            idle.append(f"--retokenize does nothing: {self.data} is not a `marslm distill` file")
        if self.cut_answers:
            if not distill:
                idle.append(f"{flag('cut_answers')} does nothing: {self.data} is not a `marslm distill` file")
            elif not self.answer_ids:
                idle.append(f"{flag('cut_answers')} does nothing with --retokenize (a cut answer trains on its ids)")
            elif not unfinished_path(self.data).is_file():
                idle.append(f"{flag('cut_answers')} does nothing: there is no {unfinished_path(self.data)}")
        return idle
