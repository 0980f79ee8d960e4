"""vLLM engine arguments that turn MARS decoding on: one recipe for ``LLM(...)`` and ``vllm serve``.

MARS rides on vLLM's speculative-decoding path. The checkpoint is its own drafter, with no extra
weights and no extra forward: the proposer drafts mask tokens, the target forward that verifies
drafts also reads the masks, and three small pieces decide what is kept:

    speculative_config   {"method": "custom_class", "model": PROPOSER}: drafts [predictions,] masks
    scheduler_cls        SCHEDULER: re-feeds accepted mask positions as real tokens (threshold)
    rejection sampler    installed by the ``vllm.general_plugins`` entry point (plugin.py)

Per-request settings travel in ``SamplingParams.extra_args``; the server's defaults and the
checkpoint's mask token in ``additional_config`` (request_settings.py). This module imports nothing of
vLLM: the CLI builds server command lines with it from marslm's own environment.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..decode.params import check_mask_batch_limit
from ..mars_json import MarsConfig
from .exact import adapter_spec, export_lora, vllm_lora_rank
from .request_settings import PluginConfig, check_request

PROPOSER = "marslm.vllm.proposer.MarsProposer"
SCHEDULER = "marslm.vllm.scheduler.MarsScheduler"
MIDDLEWARE = "marslm.vllm.middleware.MarsMiddleware"
SPECULATIVE = ("mars", "ngram", "none")
NGRAM_MAX = 4
CPU_DTYPE_BYTES = 4  # engine_kwargs(cpu=True) serves in float32
VLLM_MAX_NUM_SEQS = 256  # vLLM's own default, where --max-num-seqs is not given
KV_HEADROOM = 1.25  # the speculative slots and the partly filled blocks on top of the tokens themselves
GIB = 2**30


def plugin_config(
    model_dir: str | Path,
    *,
    tau: float = 0.95,
    metric: str = "prob",
    mode: str = "threshold",
    mask_batch_limit: int | None = None,
) -> PluginConfig:
    """The checkpoint's mask token and block size (``marslm.json``), or none for a plain AR checkpoint;
    the server's defaults, and ``mask_batch_limit``: above that many rows in a step, none drafts."""
    check_request({"mode": mode})  # the server's default mode, checked as a request's
    check_mask_batch_limit(mask_batch_limit, "--mask-batch-limit")
    mars = MarsConfig.load(model_dir) if Path(model_dir).is_dir() else None
    if mars is None or mars.stage != "mars" or mars.mask_token_id is None or mars.block_size < 1:
        return PluginConfig(tau=tau, metric=metric, mode=mode)
    spec = adapter_spec(model_dir, mars)  # an exact checkpoint's adapter, served as vLLM's LoRA (exact.py)
    lora = export_lora(model_dir, spec) if spec is not None else None
    exact = {}
    if lora is not None:
        exact = dict(exact_lora=lora.directory, exact_rank=lora.rank, exact_rows=lora.rows, exact_modules=lora.modules)
    settings = dict(tau=tau, metric=metric, mode=mode, mask_batch_limit=mask_batch_limit)
    return PluginConfig(mask_token_id=mars.mask_token_id, num_masks=mars.block_size, **settings, **exact)


def engine_kwargs(
    model_dir: str | Path,
    *,
    speculative: str = "mars",
    plugin: PluginConfig | None = None,
    cpu: bool = False,
    scheduler_cls: str = SCHEDULER,
) -> dict:
    """Keyword arguments of ``vllm.LLM`` / ``EngineArgs`` for one model directory.

    ``speculative``: ``mars`` (falls back to none for a checkpoint without masks), ``ngram``
    (vLLM's prompt lookup, a baseline) or ``none``. ``cpu`` adds what vLLM's CPU backend needs
    for small models: fp32, eager mode, KV blocks of 32.
    """
    if speculative not in SPECULATIVE:
        raise ValueError(f"speculative must be one of {SPECULATIVE}, got {speculative!r}")
    plugin = plugin or plugin_config(model_dir)
    kwargs: dict = {"model": str(model_dir)}
    if speculative == "mars" and plugin.mask_token_id is not None:
        kwargs["speculative_config"] = {
            "method": "custom_class",
            "model": PROPOSER,
            "num_speculative_tokens": plugin.num_speculative_tokens,
        }
        kwargs["additional_config"] = plugin.to_additional_config()
        if plugin.exact_rank:
            # the adapter's LoRA, which the plugin maps onto the mask tokens alone (exact_runner.py)
            kwargs.update(
                enable_lora=True,
                max_loras=1,
                max_lora_rank=vllm_lora_rank(plugin.exact_rank),
                lora_target_modules=list(plugin.exact_modules),
            )
        if plugin.exact_lora:
            # the mask rows go in by a Python branch on each step's gate, which a compiled or
            # graph-captured forward would fix at its first trace
            kwargs["enforce_eager"] = True
    elif speculative == "ngram":
        kwargs["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": max(plugin.num_masks, 1),
            "prompt_lookup_max": NGRAM_MAX,
            "prompt_lookup_min": 2,
        }
    if "speculative_config" in kwargs:
        # Per-request acceptance counts: the scheduler counts every forward into them, so the
        # middleware can report tokens per forward in `usage`.
        kwargs["per_request_spec_decode_metrics"] = "summary"
        kwargs["scheduler_cls"] = scheduler_cls
    if cpu:
        kwargs.update(dtype="float32", enforce_eager=True, block_size=32)
    return kwargs


def server_args(kwargs: dict) -> list[str]:
    """``vllm serve`` flags for ``engine_kwargs`` (the model goes first, as vLLM wants it)."""
    args = [kwargs["model"]]
    for name, value in kwargs.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    if "speculative_config" in kwargs:
        args += ["--middleware", MIDDLEWARE]
    return args


def cpu_kv_cache_gib(
    config: dict,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int = VLLM_MAX_NUM_SEQS,
    available_bytes: int | None = None,
    dtype_bytes: int = CPU_DTYPE_BYTES,
) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, as vLLM reads it) for a model's ``config.json``.

    Left unset, vLLM's CPU backend asks for most of a NUMA node's memory and will not start on a
    machine that other processes share. Enough is what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens hold (layers x key/value heads x head size x keys and values x dtype
    bytes per token), with headroom; at most half of ``available_bytes`` when that is less, but
    never less than one sequence of ``max_model_len`` tokens, which vLLM requires.
    """
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 2 * dtype_bytes
    length = max_model_len or config.get("max_position_embeddings") or 2048
    wanted = KV_HEADROOM * per_token * length * max_num_seqs
    if available_bytes is not None:
        wanted = max(min(wanted, available_bytes / 2), KV_HEADROOM * per_token * length)
    return max(1, math.ceil(wanted / GIB))


def cpu_kv_cache_default(model_dir: str | Path, vllm_args=(), max_num_seqs: int | None = None) -> int | None:
    """:func:`cpu_kv_cache_gib` for a model directory under the ``vllm serve`` options that size it
    (``--max-model-len``, ``--max-num-seqs``) and the memory available now; None for a hub id."""
    config_path = Path(model_dir, "config.json")
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return cpu_kv_cache_gib(
        config,
        max_model_len=_int_option(vllm_args, "--max-model-len"),
        max_num_seqs=_int_option(vllm_args, "--max-num-seqs") or max_num_seqs or VLLM_MAX_NUM_SEQS,
        available_bytes=_available_memory(),
    )


def _int_option(args, flag: str) -> int | None:
    """The integer value of ``flag`` in a command line (``--flag N`` or ``--flag=N``; the last wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return int(value) if value is not None and value.isdigit() else None


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
