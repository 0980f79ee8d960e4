"""How to decode, validated in one place: per request and per decoder.

:class:`DecodingParams` is one request's settings (in the manner of vLLM's ``SamplingParams``):
every surface that decodes (``marslm.generate``, the CLI, evaluation, the server, the lm-eval
adapter) builds one and calls :meth:`DecodingParams.validate`. :class:`DecoderOptions` is how the
decoder runs for every request of a call (cache policy, which masks a step reads), checked when
it is made. None of the surfaces checks a decoding setting itself; the servers read a request's
fields from its JSON body with :func:`read_field` and check those that are not ``DecodingParams``
fields (a server's default tau, :func:`check_default_tau`) here too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from ..errors import UserError
from ..mars_json import DEFAULT_BLOCK_SIZE
from ..settings import int_or_auto, setting
from .compile_policy import check_compile

METRICS = ("prob", "entropy", "margin")


@dataclass(frozen=True)
class Mode:
    """What the decoder and the checks need to know of a decoding mode before a step; what the
    mode accepts after it is its rule, ``rules.ACCEPTANCE[name]``. A mode is these two entries."""

    drafts: bool  # its rows feed the masks' predictions of one step as drafts, which the next verifies
    reads_tau: bool  # its rule reads tau (so a row in it at tau 1 reads no masks unless it drafts)
    samples: bool  # it may sample (temperature > 0)
    help: str


MODE_SPECS = {
    "threshold": Mode(False, True, True, "accept while confident (tau)"),
    "lossless": Mode(True, False, True, "the masks draft, the next forward verifies, and the output is the AR model's"),
    # the paper's section 4.6 with the model as its own drafter: a composition of the other two
    "hybrid": Mode(
        True,
        True,
        False,
        "lossless, then the confident (tau) predictions of the masks after the verified drafts (greedy only; "
        "tau 1: lossless)",
    ),
}
MODES = tuple(MODE_SPECS)  # the built-in modes, as the command line offers them
# The metrics whose tau lives in (0, 1] with "higher = stricter": a server's default tau applies to
# them. Entropy runs the other way (accept while H <= tau), so an entropy request names its tau.
DEFAULT_TAU_METRICS = ("prob", "margin")
CACHE_MODES = ("none", "block", "cursor")  # none: recompute; block: the paper's; cursor: ours (batch.py)
MAX_STOP_SEQUENCES = 4  # as OpenAI's API
# A temperature below this samples the argmax in all but rounding, and dividing logits by it can
# overflow float32 into NaN probabilities: it is greedy decoding (vLLM's _SAMPLING_EPS does the same).
MIN_TEMPERATURE = 1e-5
# Token ids are 32-bit (tokenizers), so a top_k from here on exceeds every vocabulary: it keeps
# every token, as 0 does (and stays within the decoder's 64-bit integers).
MAX_VOCAB = 2**32
# The decoder's fallback where masks do not pay (rules.py, costs.py): rows rest from masks they keep
# refusing, and no row reads masks at batch sizes where a masked step costs more than it buys by the
# checkpoint's saved cost table. The paper's sampler reads every mask at every step
# (adaptive_width=False, mask_batch_limit=None); the fallback changes the text at tau < 1, but only
# as a function of the model, the inputs, the settings and that table: never of a clock.
ADAPTIVE_WIDTH = True
MASK_BATCH_LIMIT = "auto"
PAPER_RULE = {"adaptive_width": False, "mask_batch_limit": None}  # DecoderOptions' fields: every mask, every step
# A MARS drafter's threshold (draft_model.py) when none is given, on the top-1 probability whatever
# the request's metric. The target verifies every draft, so the drafter's tau trades how far one of
# its forwards reaches against how many of its drafts are kept; at the request's tau 1 the text is
# the target's whatever is drafted. The request's tau cannot stand in: it sets what the target
# accepts unverified, and at 1 (plain speculative decoding) it would leave the drafter's masks unread.
DEFAULT_DRAFT_TAU = 0.9
DRAFT_METRIC = "prob"
MAX_DRAFT_TOKENS = 16  # drafts per step; each adds a mask group to the target's forward


def metric_code(metric: str) -> int:
    """A metric's code in the per-row arrays (acceptance.py, the vLLM plugin): its place in ``METRICS``."""
    return METRICS.index(metric)


PROB, ENTROPY, MARGIN = map(metric_code, ("prob", "entropy", "margin"))


class ParamError(UserError):
    """A decoding setting out of range; ``param`` names it (the server answers with it)."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class DecodingParams:
    """One request's decoding settings; the decoding options of the CLI are these fields. A
    server's request leaves ``tau`` and ``max_new_tokens`` None where it names none: the server's
    defaults (``marslm.serve.requests.request_params``); :meth:`validate` takes numbers."""

    tau: float | None = setting(
        1.0,
        "confidence threshold: accept mask predictions while they pass it; 1 (prob, "
        "margin) or 0 (entropy) is one token per forward, plain greedy AR",
    )
    metric: str = setting(
        "prob",
        "confidence metric: top-1 probability, top-1 minus top-2, or entropy (accept while below tau, in nats)",
        choices=METRICS,
    )
    block_size: int | None = setting(
        None, "masks per step + 1, at most the block size the checkpoint was trained with (default: that one)"
    )
    max_new_tokens: int | None = setting(256, "longest answer, in tokens")
    mode: str = setting(
        "threshold",
        "; ".join(f"{name}: {mode.help}" for name, mode in MODE_SPECS.items()),
        choices=MODES,
    )
    temperature: float = setting(0.0, "0: greedy; > 0 samples (lossless mode: exactly the AR model's distribution)")
    top_p: float = setting(1.0, "nucleus sampling: keep the smallest set of tokens holding this much mass")
    top_k: int = setting(0, "sample among the k most likely tokens (0: all)")
    seed: int | None = setting(None, "sampling seed: the same seed gives the same answer, whatever the batch")
    stop: tuple[str, ...] = setting(
        (), "end the answer just before this text (repeat for up to 4)", metavar="TEXT", repeat=True
    )

    def validate(self, trained_block_size: int | None = None, context: int | None = None) -> DecodingParams:
        """Check every field; return a copy with ``block_size`` resolved against the checkpoint's.
        ``context``: the model's (``max_position_embeddings``), which an answer must fit beside a
        prompt of at least one token."""
        check_tau(self.tau, self.metric)
        check_mode(self.mode)
        block_size = self.block_size if self.block_size is not None else (trained_block_size or DEFAULT_BLOCK_SIZE)
        if not isinstance(block_size, int) or block_size < 1:
            raise ParamError(f"block size must be an integer >= 1, got {block_size!r}", "block_size")
        if trained_block_size is not None and block_size > trained_block_size:
            raise ParamError(
                f"block size must be in 1..{trained_block_size} (the block size the model was "
                f"trained with), got {block_size}",
                "block_size",
            )
        if MODE_SPECS[self.mode].drafts and block_size < 2:
            raise ParamError(f"{self.mode} mode needs at least one mask to draft from (block size >= 2)", "block_size")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ParamError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}", "max_tokens")
        if context is not None and self.max_new_tokens > context - 1:
            raise ParamError(
                f"max_new_tokens must be at most {context - 1} (the model's context of {context} tokens, less "
                f"a prompt token), got {self.max_new_tokens}",
                "max_tokens",
                "context_length_exceeded",
            )
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= 2):
            raise ParamError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not MODE_SPECS[self.mode].samples and self.temperature >= MIN_TEMPERATURE:
            sampling = " or ".join(name for name, mode in MODE_SPECS.items() if mode.samples)
            raise ParamError(f"{self.mode} mode decodes greedily; sample with mode {sampling}", "temperature")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParamError(f"top_k must be an integer >= 0, got {self.top_k!r}", "top_k")
        if self.seed is not None:
            check_seed(self.seed, "seed")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in stop):
            raise ParamError(f"stop must be up to {MAX_STOP_SEQUENCES} non-empty strings", "stop")
        return replace(
            self,
            block_size=block_size,
            stop=stop,
            temperature=0.0 if self.temperature < MIN_TEMPERATURE else self.temperature,
            top_k=0 if self.top_k >= MAX_VOCAB else self.top_k,
        )

    @property
    def one_token(self) -> bool:
        """Plain AR decoding: threshold mode at tau 1 (prob/margin) or 0 (entropy)."""
        return one_token(self.tau, self.metric, self.mode)

    def check_mask_token(self, has_mask_token: bool) -> None:
        """Refuse settings that read masks for a model without a mask token."""
        if not has_mask_token and not self.one_token:
            raise ParamError(
                "the model has no mask token to decode with: not a MARS checkpoint, or an exact-mode one loaded "
                "without its adapter (load it with marslm.load). Only tau = 1 (plain AR decoding) works without one",
                "tau",
            )

    @staticmethod
    def check_prompt_ids(prompt_ids, mask_token_id: int | None) -> None:
        """A prompt holds no ``mask_token_id`` (given where an exact checkpoint's adapter acts at it: a
        mask in a prompt would switch the adapter on at a clean position). Where masks go is the
        decoder's to say."""
        if mask_token_id is not None and mask_token_id in prompt_ids:
            at = list(prompt_ids).index(mask_token_id)
            raise ParamError(
                f"the prompt holds the mask token's id {mask_token_id} (at token {at}): masks are placed by the "
                "decoder, never read from a prompt",
                "prompt",
                "mask_token_in_prompt",
            )

    def check_prompt(self, prompt_tokens: int, context: int | None) -> None:
        """The prompt and the longest answer fit the model's context, as the server requires."""
        if context is None:
            return
        if prompt_tokens >= context:
            raise ParamError(
                f"the prompt has {prompt_tokens} tokens; the model's context is {context}",
                "prompt",
                "context_length_exceeded",
            )
        if prompt_tokens + self.max_new_tokens > context:
            raise ParamError(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({self.max_new_tokens}) exceeds the "
                f"model's context of {context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )


@dataclass(frozen=True)
class DecoderOptions:
    """How the decoder runs, the same for every prompt of a call; checked when made."""

    cache: str = setting(
        "cursor",
        "KV cache policy: cursor (each row commits every step), block (the paper's: blocks committed in "
        "lockstep, static batches, greedy threshold mode) or none (recompute)",
        choices=CACHE_MODES,
    )
    block_cache_size: int = setting(16, "positions per block of --cache block")
    use_last_mask: bool = setting(
        True,
        "ignore the last mask's prediction (the authors' sampler; default: use it, B+1 candidates per step: "
        "training teaches exactly that case)",
        negative="--no-last-mask",
    )
    draft_groups: bool = setting(False, "lossless and hybrid: one mask group per possible accepted-draft count")
    adaptive_width: bool = setting(
        ADAPTIVE_WIDTH,
        "rest a row from masks (1, 2, 4 .. 16 steps) after steps running that accepted none of them: "
        "cheaper where masks are rarely confident, but at tau < 1 it changes the text, not only the reach "
        "(on by default; --no-adaptive-width with --mask-batch-limit off: every step reads its masks, as "
        "the paper's rule does)",
    )
    mask_batch_limit: int | str | None = setting(
        MASK_BATCH_LIMIT,
        "while more rows than this decode together, none reads masks: plain AR steps; auto (the default): "
        "read masks at the batch sizes where what they buy exceeds what they cost by the cost table "
        "`marslm bench --cost-curve --save` keeps beside the checkpoint (no table: no limit), trying them "
        "once in 16 steps where they pay at none; off: no limit. Nothing is timed while decoding",
        parse=int_or_auto,
        metavar="N|auto|off",
    )
    compile: bool | str = setting(
        "auto",
        "torch.compile the decoding step (fullgraph, one graph per bucket of rows and width, over a static KV "
        "cache; the output is the eager step's): auto (the default) compiles the cursor cache's step where "
        "inductor can (CUDA; a CPU with a C++ compiler) and says why not elsewhere; the graphs are kept in "
        "marslm's cache, so only the first process on a machine pays for them",
        cli=False,
    )

    def __post_init__(self):
        if self.cache not in CACHE_MODES:
            raise UserError(f"cache must be one of {', '.join(CACHE_MODES)}, got {self.cache!r}")
        check_compile(self.compile)
        if self.compile is True and self.cache != "cursor":
            raise UserError(f"compile runs the cursor cache's step; cache={self.cache!r} decodes eagerly")
        if isinstance(self.block_cache_size, bool) or not isinstance(self.block_cache_size, int):
            raise UserError(f"block_cache_size must be an integer >= 1, got {self.block_cache_size!r}")
        if self.block_cache_size < 1:
            raise UserError(f"block_cache_size must be >= 1, got {self.block_cache_size}")
        check_mask_batch_limit(self.mask_batch_limit, "mask_batch_limit", auto=True)

    def validate(self, params: DecodingParams, context: int | None = None) -> None:
        """Refuse request settings this decoder cannot run; ``context``: the model's, which bounds a
        block of the block cache."""
        if context is not None and self.block_cache_size > context:
            raise UserError(
                f"block_cache_size must be at most the model's context of {context} tokens, got {self.block_cache_size}"
            )
        if self.cache == "block" and (params.mode != "threshold" or params.temperature > 0):
            raise UserError("the block cache decodes greedily in threshold mode; use cache='cursor'")
        if self.draft_groups and params.mode == "threshold":
            raise UserError("draft_groups does nothing in threshold mode (its mask groups are lossless and hybrid's)")


def one_token(tau: float, metric: str, mode: str = "threshold") -> bool:
    """Whether a setting is plain AR decoding, one token per forward (:func:`one_token_rows`): a
    mode that reads tau and does not draft, at tau 1."""
    spec = MODE_SPECS.get(mode)  # a report's other decoders (the ablation's Jacobi rows) are none
    return spec is not None and spec.reads_tau and not spec.drafts and bool(one_token_rows(tau, metric_code(metric)))


def one_token_rows(tau, metric):
    """Rows whose setting means plain AR decoding: exactly one token per forward. The one
    definition of one-token mode: tau and metric codes per row (torch or numpy), or one of each.
    Written with comparisons alone so that it needs neither library."""
    return ((metric == ENTROPY) & (tau <= 0)) | ((metric != ENTROPY) & (tau >= 1))


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ParamError(f"unknown confidence metric {metric!r}; choose from {', '.join(METRICS)}", "metric")


def check_mode(mode: str) -> None:
    if mode not in MODE_SPECS:
        raise ParamError(f"mode must be one of {', '.join(MODE_SPECS)}, got {mode!r}", "mode")


def reads_tau(mode: str) -> bool:
    """Whether a mode's acceptance reads tau (lossless ignores it)."""
    return mode in MODE_SPECS and MODE_SPECS[mode].reads_tau


def check_tau(tau: float, metric: str) -> None:
    """The metric must be known; tau finite, in (0, 1] for prob and margin, and >= 0 for entropy."""
    check_metric(metric)
    if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not math.isfinite(tau):
        raise ParamError(f"tau must be a finite number, got {tau!r}", "tau", "invalid_tau")
    if metric == "entropy":
        if tau < 0:
            raise ParamError(f"tau for the entropy metric must be >= 0, got {tau}", "tau", "invalid_tau")
    elif not 0 < tau <= 1:
        raise ParamError(f"tau for the {metric} metric must be in (0, 1], got {tau}", "tau", "invalid_tau")


def check_default_tau(metric: str, mode: str) -> None:
    """A request that names no tau follows its server's default tau, a probability: refused where
    its metric reads tau on another scale and its mode reads tau at all."""
    if metric in METRICS and metric not in DEFAULT_TAU_METRICS and reads_tau(mode):
        raise ParamError(
            f"the server's default tau is a probability; a request with metric {metric!r} must set its own tau",
            "tau",
        )


def check_draft_tau(tau) -> None:
    """A MARS drafter's tau: a threshold on the top-1 probability (``DRAFT_METRIC``)."""
    try:
        check_tau(tau, DRAFT_METRIC)
    except ParamError as exc:
        raise ParamError(f"draft_tau: {exc}", "draft_tau") from None


def check_seed(seed, name: str) -> None:
    """A sampling seed: an integer in 0..2^63-1 (what a torch generator takes); ``name`` is how the
    caller spells the option."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ParamError(f"{name} must be an integer in 0..2^63-1, got {seed!r}", "seed")


def check_mask_batch_limit(limit, name: str, auto: bool = False) -> None:
    """None (no limit) or an integer >= 1, or with ``auto`` the word auto; ``name`` is how the
    caller spells the option."""
    if auto and limit == "auto":
        return
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        also = ", auto" if auto else ""
        unset = "None (off on the command line): no limit"
        raise UserError(f"{name} must be an integer >= 1{also} or {unset}, got {limit!r}")


# ------------------------------------------------------------------- a request's fields, as JSON
# A server reads a request's fields with these: marslm serve's OpenAI API and the vLLM plugin's
# front door alike, so a field is refused in the same words wherever it is sent.
_MISSING = object()


def read_field(body: dict, name: str, kind: str, default=None, *, required: bool = False):
    """``body[name]`` checked against ``kind`` (int, number, str, bool, list, dict); None counts as absent."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise ParamError(f"missing required parameter '{name}'", param=name, code="missing_required_parameter")
        return default
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "list": isinstance(value, list),
        "dict": isinstance(value, dict),
    }[kind]
    if not ok:
        kind_name = {
            "int": "an integer",
            "number": "a number",
            "str": "a string",
            "bool": "a boolean",
            "list": "an array",
            "dict": "an object",
        }[kind]
        raise ParamError(f"'{name}' must be {kind_name}, got {describe(value)}", param=name, code="invalid_type")
    return float(value) if kind == "number" else value


def describe(value) -> str:
    """A value for an error message: short, and safe for any nesting depth."""
    if isinstance(value, (list, dict)):
        return f"an {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    return json.dumps(value)[:80]
