"""Every ``marslm serve`` knob in one object, checked once as it is made: the CLI's options, the
engine's and the HTTP server's settings are its fields (settings.py), so each default is written
once, and whatever holds a ``ServeConfig`` holds a valid one (it is frozen)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..decode.compile_policy import check_compile
from ..decode.draft_options import DraftOptions
from ..decode.params import ADAPTIVE_WIDTH, MASK_BATCH_LIMIT, check_mask_batch_limit, check_seed, check_tau
from ..errors import UserError
from ..settings import DTYPE_NAMES, flag_of, int_or_auto, setting
from .engines import NAMES

POLICIES = ("fixed", "adaptive")
DEFAULT_MAX_MODEL_LEN = 2048
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServeConfig:
    host: str = setting("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = setting(8000, "port (0 picks a free one)")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' (except /health, /metrics)")
    dtype: str = setting(
        "auto", "weights dtype (auto: as saved); float64 makes batching unable to flip near-ties", choices=DTYPE_NAMES
    )
    device: str = setting("auto", "torch device (auto: cuda if available, else cpu)")
    threads: int | None = setting(
        None, "torch threads for a model on the CPU (default: the cores less one, so the HTTP front end keeps one)"
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "names clients may send for the model, the first in answers (default: the model directory's "
        "name, or the hub id); the --model path or hub id is served too",
        nargs="+",
        metavar="NAME",
    )
    engine: str = setting(
        "marslm",
        "marslm: this package's engine; vllm: vLLM's OpenAI server with the MARS "
        "plugin, from the environment `make vllm-env` makes",
        choices=NAMES,
    )
    log_level: str = setting("info", "server log level", choices=LOG_LEVELS)
    max_batch: int = setting(16, "requests decoded together")
    mask_batch_limit: int | str | None = setting(
        MASK_BATCH_LIMIT,
        "a load policy: read masks only while at most this many requests decode together, above it plain "
        "AR steps (where a forward is compute-bound, as on a CPU at a large batch, masks cost more than "
        "they buy); auto (the default): where the checkpoint's cost table says the tokens masks buy "
        "exceed what they cost (the table beside it, else the one marslm's cache keeps for this machine, "
        "measured before the server says it is ready); off: every batch size reads masks. A request's "
        "text at tau < 1 then depends on the load; each response names the limit it ran under. vLLM has "
        "no table of its own: there auto is off",
        parse=int_or_auto,
        metavar="N|auto|off",
    )
    adaptive_width: bool = setting(
        ADAPTIVE_WIDTH,
        "rest a row from masks after steps running that accepted none of them: cheaper where masks are "
        "rarely confident, but at tau < 1 it changes the text (default: on; with --no-adaptive-width "
        "--mask-batch-limit off every step reads its masks, the paper's rule)",
    )
    compile: bool | str = setting("auto", "see DecoderOptions: the --compile/--no-compile flag", cli=False)
    max_model_len: int | None = setting(
        None,
        "longest prompt plus answer a request may have, in tokens (default: the model's context, at most "
        f"{DEFAULT_MAX_MODEL_LEN}): a compiled step's static cache holds this many per row, and its graphs "
        "are compiled for it before the server says it is ready",
    )
    max_queue: int = setting(256, "requests that may wait for a batch row; beyond it: 429 with Retry-After")
    max_tokens: int = setting(256, "max_tokens of a request that names none")
    max_tokens_limit: int = setting(4096, "largest max_tokens accepted")
    seed: int = setting(0, "seed of sampling for requests that name no seed")
    tau: float = setting(0.95, "default tau for requests that name none; the adaptive policy's ceiling")
    tau_policy: str = setting(
        "fixed",
        "fixed: the default tau stays put; adaptive: it falls toward --tau-floor as "
        "the queue grows or steps pass --slo-ms, and recovers as load falls",
        choices=POLICIES,
    )
    tau_floor: float = setting(0.9, "lowest default tau of the adaptive policy")
    slo_ms: float | None = setting(None, "step latency above which the adaptive policy lowers tau")
    shutdown_timeout: float = setting(
        30.0,
        "on SIGTERM, seconds in-flight requests may take to finish before "
        "they are cancelled (a 503 error object, or a last stream event)",
    )
    max_request_bytes: int = setting(2**20, "largest request body; a larger one is refused (413) as it arrives")
    header_timeout: float = setting(10.0, "seconds a connection may take to send a request's line and headers")
    body_timeout: float = setting(30.0, "seconds a request's body may take to arrive, then 408")
    keep_alive_timeout: float = setting(5.0, "seconds an idle keep-alive connection stays open")
    max_connections: int = setting(1024, "open connections; one more is answered 503 and closed")
    drafting: DraftOptions = setting(DraftOptions(), "a separate drafter", cli=False)  # the CLI's --draft-model

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field in range, or one ``UserError`` line naming its flag."""

        def flag(name):
            return flag_of(ServeConfig, name)

        check_tau(self.tau, "prob")
        check_tau(self.tau_floor, "prob")
        if self.tau_floor > self.tau:
            raise UserError(f"{flag('tau_floor')} {self.tau_floor} is above {flag('tau')} {self.tau}")
        for name in (
            "max_batch",
            "max_queue",
            "max_tokens",
            "max_tokens_limit",
            "max_request_bytes",
            "max_connections",
            "threads",
        ):
            value = getattr(self, name)
            if value is None and name == "threads":  # unset: the default
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{flag(name)} must be an integer >= 1, got {value}")
        if not 0 <= self.port <= 65535:
            raise UserError(f"{flag('port')} must be in 0..65535, got {self.port}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            zero_ok = name == "shutdown_timeout"  # 0: cancel in-flight requests at once
            if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
                raise UserError(
                    f"{flag(name)} must be a finite number of seconds {'>=' if zero_ok else '>'} 0, got {value}"
                )
        if not isinstance(self.served_model_name, tuple) or not all(
            isinstance(name, str) and name for name in self.served_model_name
        ):
            raise UserError(f"{flag('served_model_name')} must be non-empty names, got {self.served_model_name!r}")
        check_mask_batch_limit(self.mask_batch_limit, flag("mask_batch_limit"), auto=True)
        check_compile(self.compile)
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise UserError(f"{flag('max_model_len')} must be an integer >= 2, got {self.max_model_len!r}")
        if self.drafting.draft_model is not None:
            refuse_with_drafter(self)
        check_seed(self.seed, flag("seed"))
        if self.slo_ms is not None and not (math.isfinite(self.slo_ms) and self.slo_ms > 0):
            raise UserError(f"{flag('slo_ms')} must be a finite number > 0, got {self.slo_ms}")
        for name, allowed in (
            ("tau_policy", POLICIES),
            ("dtype", DTYPE_NAMES),
            ("engine", NAMES),
            ("log_level", LOG_LEVELS),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(f"{flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")


def refuse_with_drafter(config: ServeConfig) -> None:
    """What a server with a separate drafter cannot honour: it decodes one request at a time, so a
    number of rows to limit masks by means nothing (``auto``, the default, limits nothing there).
    Every drafted step reads its masks, so the default fallback (adaptive width), the batch
    decoder's, does not apply."""
    if config.mask_batch_limit not in (None, "auto"):
        raise UserError(
            f"{flag_of(ServeConfig, 'mask_batch_limit')} limits masks by batch size; with "
            f"{flag_of(DraftOptions, 'draft_model')} requests decode one at a time"
        )


def served_names(model: str, aliases: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names a client may send for ``model``: ``aliases`` (``--served-model-name``; by default
    a local directory's name, or the hub id), then ``model`` as the server was started with it,
    which is what vLLM serves by default. Answers carry the first, as vLLM's do."""
    default = Path(model).resolve().name if Path(model).exists() else model
    return tuple(dict.fromkeys((*(aliases or (default,)), model)))


def no_extra_args(extra_args) -> None:
    """Options after ``--`` go to ``vllm serve``: refused unless the engine is vLLM."""
    if extra_args:
        raise UserError(f"unexpected arguments {' '.join(extra_args)} (options after -- are for --engine vllm)")


def served_context(model_context: int | None, max_model_len: int | None) -> int:
    """The longest prompt plus answer the server takes: ``--max-model-len``, else the model's
    context up to ``DEFAULT_MAX_MODEL_LEN``."""
    bound = max_model_len or DEFAULT_MAX_MODEL_LEN
    return bound if model_context is None else min(model_context, bound)
