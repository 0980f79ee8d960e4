"""``marslm bench``'s settings: :class:`BenchConfig`, checked when it is made, and the lists its
options choose from. Torch-free, so the CLI builds its parser without loading torch; the runs are
in bench.py (decoding speed, the cost curve) and train_step.py (``--train-step``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..decode.draft_options import DraftOptions
from ..decode.params import ADAPTIVE_WIDTH, MASK_BATCH_LIMIT, DecoderOptions, check_tau
from ..errors import UserError
from ..files import output_file
from ..settings import DTYPE_NAMES, check_count, flag_of, floats, ints, setting, strings

# Contender groups `--contenders` selects from; HF generate on the AR checkpoint always runs (the baseline).
CONTENDER_GROUPS = (
    "hf-mars",
    "lookup",
    "none",
    "block",
    "cursor",
    "cursor-paper",
    "cursor-adaptive",
    "cursor-limit",
    "cursor-auto",
    "lossless",
    "lossless-groups",
    "hybrid",
    "hybrid-groups",
    "draft",
    "draft-ar",
    "assisted",
)
# The groups a separate drafter (--draft-model) runs in: the paper's section 4.6 and its baselines.
DRAFTER_GROUPS = ("draft", "draft-ar", "assisted")
TRAIN_STEP_FIELDS = (  # BenchConfig's fields that only --train-step reads (an option group of their own)
    "train_step",
    "shape",
    "layers",
    "seq_lens",
    "prompt_share",
    "logits",
    "attention",
    "gradient_checkpointing",
    "bf16",
)
# Named model shapes (random weights): the configs of public checkpoints, so memory and time are
# those of the real model without downloading it. ``layers`` may be cut with --layers.
SHAPES = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
}


@dataclass
class BenchConfig:
    """One ``marslm bench`` run; its options are these fields (settings.py), checked when it is made.

    Three modes share them: decoding speed (the default), ``cost_curve`` and ``train_step``; each
    checks the fields it reads.
    """

    model: str | None = setting(None, "MARS checkpoint directory (with --train-step: any checkpoint, or use --shape)")
    ar_model: str | None = setting(
        None,
        "AR checkpoint directory, the baseline (HF generate with KV cache); required unless "
        "--cost-curve or --train-step. For a pretrained model fine-tuned with MARS: the original model",
    )
    data: list = setting(
        ["toy"],
        "comma-separated evaluation sets, each benchmarked in turn ('reworded' is the off-distribution set)",
        parse=strings,
    )
    batch_sizes: list = setting(
        [1, 4, 8], "comma-separated batch sizes (--train-step: rows per step, the first)", parse=ints
    )
    n: int = setting(32, "prompts per contender and batch size")
    repeats: int = setting(3, "timed repeats, after a warm-up")
    max_new_tokens: int = setting(128, "longest answer, in tokens")
    taus: list = setting([0.95, 0.9], "comma-separated taus of the MARS threshold and hybrid contenders", parse=floats)
    contenders: list | None = setting(
        None,
        "comma-separated contender groups besides HF generate on --ar-model, which always runs; all by "
        f"default ({', '.join(DRAFTER_GROUPS)} only with --draft-model)",
        parse=strings,
    )
    cost_curve: bool = setting(False, "measure forward time against fed width instead of decoding")
    contexts: list = setting([128, 512], "--cost-curve: cached context lengths", parse=ints)
    profile: bool = setting(
        False,
        "--cost-curve: also profile the one-token step and a masked step (B + 1 columns) at the first batch "
        "size and context: each one's costliest operators (with --compile, eager and compiled)",
    )
    save: bool = setting(
        False,
        "--cost-curve: keep a masked step's cost per batch size beside the checkpoint (marslm-costs.json): "
        "the table that mask_batch_limit auto decides from, so decoding times nothing",
    )
    block_size: int | None = setting(
        None,
        "B: the masks a MARS contender's step reads (at most the checkpoint's); --cost-curve: widths "
        "1 .. 2B + 2; --train-step: B (default: the checkpoint's, else 4)",
    )
    train_step: bool = setting(False, "time a MARS training step against an AR step instead of decoding")
    shape: str | None = setting(
        None, "a named model shape with random weights instead of --model (no download)", choices=sorted(SHAPES)
    )
    layers: int | None = setting(None, "--shape: keep only this many decoder layers")
    seq_lens: list = setting([256, 512], "tokens per row", parse=ints)
    prompt_share: float = setting(0.3, "untrained share of each row")
    logits: str = setting(
        "targets",
        "targets: the fused target-only head training uses; full: full logits at every column; both",
        choices=("targets", "full", "both"),
    )
    attention: str = setting("sdpa", "attention implementation", choices=("sdpa", "eager", "flex"))
    gradient_checkpointing: bool = setting(False, "recompute activations in the backward pass")
    bf16: bool = setting(False, "bf16 autocast (on CUDA, as training's default)")
    dtype: str = setting(
        "auto", "weights dtype of the decoded models (auto: as saved; on a CPU bfloat16 may pay)", choices=DTYPE_NAMES
    )
    # every MARS contender but the block cache's reads these (cursor-adaptive, -limit and -auto set
    # their own); the CLI's --[no-]adaptive-width and --mask-batch-limit (cli/common.py add_fallback)
    adaptive_width: bool = setting(ADAPTIVE_WIDTH, "see DecoderOptions", cli=False)
    mask_batch_limit: int | str | None = setting(MASK_BATCH_LIMIT, "see DecoderOptions", cli=False)
    # the CLI's --[no-]compile. auto: each MARS contender as its decoder's default (compiled where
    # the device can); True: each cursor-cache contender eagerly and compiled, and HF generate with
    # its static cache compiled too, so that the reader sees what compiling buys each; False: eager
    compile: bool | str = setting("auto", "see DecoderOptions", cli=False)
    device: str = setting("auto", "torch device", cli=False)  # the CLI's --device (common.py)
    drafting: DraftOptions = setting(DraftOptions(), "a separate drafter", cli=False)  # the CLI's --draft-model
    json_path: str | None = setting(None, "write the report as JSON to FILE", flag="--json", metavar="FILE")
    progress: bool = setting(True, "no progress bars", negative="--quiet")

    def __post_init__(self) -> None:
        if self.contenders is None:
            drafter = self.drafting.draft_model is not None
            self.contenders = [g for g in CONTENDER_GROUPS if drafter or g not in DRAFTER_GROUPS]
        self.validate()

    def validate(self) -> None:
        """Every field in range, or one ``UserError`` line naming its flag."""
        if self.json_path is not None:
            output_file(self.json_path, flag_of(BenchConfig, "json_path"))
        if self.n < 1 or self.repeats < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise UserError("--n, --repeats and every --batch-sizes value must be >= 1")
        counts = [("n", self.n), ("repeats", self.repeats), *(("batch_sizes", b) for b in self.batch_sizes)]
        if self.block_size is not None:
            counts.append(("block_size", self.block_size))
        for name, value in counts:
            check_count(flag_of(BenchConfig, name), value)
        DecoderOptions(adaptive_width=self.adaptive_width, mask_batch_limit=self.mask_batch_limit)  # checks them
        if self.train_step:
            self._check_train_step()
            return
        if self.model is None:
            raise UserError("--model is required")
        if self.max_new_tokens < 1:
            raise UserError(f"{flag_of(BenchConfig, 'max_new_tokens')} must be >= 1, got {self.max_new_tokens}")
        for tau in self.taus:
            check_tau(tau, "prob")
        if self.cost_curve:
            if not self.contexts or min(self.contexts) < 1 or (self.block_size is not None and self.block_size < 1):
                raise UserError("every --contexts value and --block-size must be >= 1")
            if self.save and not Path(self.model).is_dir():
                raise UserError(f"--save keeps the cost table beside a local checkpoint; {self.model} is no folder")
            return
        if self.save:
            raise UserError("--save goes with --cost-curve (it keeps the cost curve's table)")
        if self.profile:
            raise UserError("--profile goes with --cost-curve (it profiles the curve's steps)")
        if self.ar_model is None:
            raise UserError("--ar-model is required: the AR baseline is HF generate on the AR checkpoint")
        unknown = set(self.contenders) - set(CONTENDER_GROUPS)
        if unknown:
            raise UserError(
                f"unknown contender group(s) {', '.join(sorted(unknown))}; choose from {', '.join(CONTENDER_GROUPS)}"
            )
        drafted = [g for g in self.contenders if g in DRAFTER_GROUPS]
        if drafted and self.drafting.draft_model is None:
            raise UserError(f"contender group(s) {', '.join(drafted)} need --draft-model")

    def _check_train_step(self) -> None:
        if self.dtype != "auto":
            raise UserError("--dtype sets the decoded models' weights; --train-step keeps float32 (--bf16: autocast)")
        if (self.model is None) == (self.shape is None):
            raise UserError("--train-step needs exactly one of --model or --shape")
        if not self.seq_lens or min(self.seq_lens) < 2:
            raise UserError("every --seq-lens value must be >= 2")
        if not 0 <= self.prompt_share < 1:
            raise UserError(f"{flag_of(BenchConfig, 'prompt_share')} must be in [0, 1), got {self.prompt_share}")
        if self.block_size is not None and self.block_size < 1:
            raise UserError("--block-size must be >= 1")
