"""What a request asks of MARS under vLLM, and what the server defaults to: checked in one place.

A request names its settings as marslm serve's do (``tau``, ``metric``, ``mode``), and marslm
serve's own checks (decode/params.py) check them, so both servers refuse a field in the same
words. Inside vLLM they travel in ``SamplingParams.extra_args`` (the OpenAI API's
``vllm_xargs``). The server's defaults and the checkpoint's facts (mask token, block size)
travel in vLLM's ``additional_config["marslm"]``, so every engine process sees the same ones.

Each request decodes in one of three row modes:

    OFF        no drafts: exactly vLLM's own decoding (one-token tau, a sampling request, a
               checkpoint without masks)
    THRESHOLD  [AR token, mask predictions], the leading confident ones (acceptance.py)
    LOSSLESS   the masks draft, the next forward verifies: greedy output, token for token

Hybrid mode (marslm serve's), and any mode but those two, is refused here: ``refused_mode`` says why.

This module imports nothing of vLLM, so the CLI and the HTTP middleware can use it too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..decode.params import (
    ParamError,
    check_default_tau,
    check_metric,
    check_mode,
    check_tau,
    metric_code,
    one_token,
    read_field,
)

OFF, THRESHOLD, LOSSLESS = range(3)
# vLLM's sampler emits at most the drafts it verified and one token after them, and the plugin's
# scheduler re-feeds accepted mask positions only right after the AR token (sampler.py, scheduler.py)
SERVED_MODES = ("threshold", "lossless")


def refused_mode(mode: str) -> str:
    """Why a mode the plugin's sampler does not run is refused."""
    why = "its sampler cannot accept masks after verified drafts" if mode == "hybrid" else "its sampler runs two"
    return f"'mode' {mode} is not served by the vLLM plugin ({why}); use marslm serve, or mode lossless or threshold"


FIELDS = ("tau", "metric", "mode")
CONFIG_KEY = "marslm"


@dataclass(frozen=True)
class PluginConfig:
    """What every vLLM process of one server is configured with: the checkpoint's mask token and
    masks per step, and the defaults of requests that name none (``marslm serve``'s own knobs are
    ``marslm.serve.config.ServeConfig``)."""

    mask_token_id: int | None = None  # None: the engine runs without MARS (every row OFF)
    num_masks: int = 0  # masks per step: the trained block size B, so B + 1 candidates
    tau: float = 0.95
    metric: str = "prob"
    mode: str = "threshold"
    mask_batch_limit: int | None = None  # a load policy: no drafts while more rows than this decode together
    # An exact checkpoint's adapter (exact.py), exported where vLLM reads it; None: a full checkpoint
    exact_lora: str | None = None
    exact_rank: int = 0  # its LoRA rank; 0: mask rows only
    exact_rows: int = 0  # its mask rows: 1 shared, or one per offset
    exact_modules: tuple[str, ...] = ()  # the Linears its LoRA gates, by their own names (q_proj, ...)

    @property
    def num_speculative_tokens(self) -> int:
        # lossless feeds the last step's mask predictions as drafts, then a fresh set of masks
        return 2 * self.num_masks

    def to_additional_config(self) -> dict:
        return {CONFIG_KEY: asdict(self)}

    @classmethod
    def from_vllm_config(cls, vllm_config) -> PluginConfig:
        raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
        return cls(**{**raw, "exact_modules": tuple(raw.get("exact_modules", ()))}) if raw else cls()


@dataclass(frozen=True)
class RowSettings:
    mode: int  # OFF | THRESHOLD | LOSSLESS
    tau: float
    metric: int  # acceptance.py's metric code


def check_request(fields: dict, greedy: bool = True) -> None:
    """Raise ``ParamError`` for MARS fields a server must refuse (with a 400); ``fields`` may hold
    others. Each field goes through marslm serve's own checks (decode/params.py), then what only
    this plugin refuses: hybrid mode, and sampling with MARS."""
    tau = read_field(fields, "tau", "number")
    metric = read_field(fields, "metric", "str")
    mode = read_field(fields, "mode", "str")
    if metric is not None:
        check_metric(metric)
    if mode is not None:
        check_mode(mode)
    if mode is not None and mode not in SERVED_MODES:
        raise ParamError(refused_mode(mode), "mode")
    if tau is not None:
        check_tau(tau, metric or "prob")
    else:  # a request that names no mode runs in the server's default mode, which may read tau
        check_default_tau(metric or "prob", mode or "threshold")
    if not greedy and any(fields.get(name) is not None for name in FIELDS):
        raise ParamError("MARS decoding is greedy: send temperature 0 with tau, metric or mode", "temperature")


def is_greedy(temperature) -> bool:
    """vLLM's rule: a temperature under 1e-5 is greedy (None: the server's default, 0 here)."""
    return temperature is None or (isinstance(temperature, (int, float)) and temperature < 1e-5)


def request_settings(params, config: PluginConfig) -> RowSettings:
    """``row_settings`` of a vLLM ``SamplingParams``."""
    if params is None:
        return row_settings(None, True, config)
    return row_settings(params.extra_args, is_greedy(params.temperature), config)


def row_settings(extra_args: dict | None, greedy: bool, config: PluginConfig) -> RowSettings:
    """How one request decodes on this server. Its fields were checked at the front end."""
    fields = extra_args or {}
    if config.mask_token_id is None or config.num_masks < 1:
        return RowSettings(OFF, 1.0, metric_code("prob"))
    named = any(fields.get(name) is not None for name in FIELDS)
    if not greedy and not named:  # a sampling request that asks nothing of MARS: plain vLLM
        return RowSettings(OFF, 1.0, metric_code("prob"))
    metric = fields.get("metric") or config.metric
    tau = float(fields["tau"]) if fields.get("tau") is not None else config.tau
    mode = fields.get("mode") or config.mode
    if mode == "lossless":
        return RowSettings(LOSSLESS, tau, metric_code(metric))
    return RowSettings(OFF if one_token(tau, metric) else THRESHOLD, tau, metric_code(metric))
