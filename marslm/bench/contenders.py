"""The contenders of ``marslm bench``: HF ``generate`` and its assisted and prompt-lookup modes, and
MARS under each setting a contender group names (``--contenders``), eager and, with ``--compile``,
compiled; bench/speed.py runs them side by side."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..decode.compile_policy import resolve_compile
from ..decode.generation import with_overrides
from ..decode.params import PAPER_RULE, DecoderOptions, DecodingParams
from ..modeling import resolve_device
from .config import BenchConfig
from .report import HF_COMPILED

BLOCK_CACHE_SIZES = (16, 32)  # the block contenders' --block-cache-size values


@dataclass
class Contender:
    name: str
    kind: str  # "hf" | "hf-lookup" | "hf-assisted" | "mars" | "draft" (marslm's drafter, then the target)
    checkpoint: str  # "ar" | "mars"
    options: dict = field(default_factory=dict)  # as the report shows them: HF generate's keywords, or MARS settings
    params: DecodingParams | None = None  # MARS: ``options`` put into generate's settings, once
    decoder: DecoderOptions | None = None


def _mars(label: str, max_new_tokens: int, **options) -> Contender:
    """A MARS contender named ``MARS <label>``, then how it falls back where masks do not pay (see
    :func:`_fallback_label`), then its tau where given; each option goes to the settings object
    whose field it names."""
    params, decoder = with_overrides(DecodingParams(max_new_tokens=max_new_tokens), DecoderOptions(), options)
    name = f"MARS {label}" + ("" if decoder.cache == "block" else _fallback_label(decoder))
    name += f" tau={options['tau']}" if "tau" in options else ""
    return Contender(name, "mars", "mars", options, params, decoder)


def _fallback_label(decoder: DecoderOptions) -> str:
    """Nothing for the default fallback, ``paper-rule`` for none (every step reads its masks), else
    the levers that are on. The block cache reads every mask whatever these say."""
    setting = {"adaptive_width": decoder.adaptive_width, "mask_batch_limit": decoder.mask_batch_limit}
    if setting == {k: getattr(DecoderOptions, k) for k in setting}:
        return ""
    if setting == PAPER_RULE:
        return " paper-rule"
    label = " adaptive-width" if decoder.adaptive_width else ""
    return label + (f" mask-limit={decoder.mask_batch_limit}" if decoder.mask_batch_limit is not None else "")


def _fallback(config: BenchConfig) -> dict:
    """What ``--adaptive-width`` and ``--mask-batch-limit`` change from the decoder's defaults: the
    options of every contender whose decoder reads them (not the block cache's)."""
    default = DecoderOptions()
    names = ("adaptive_width", "mask_batch_limit")
    return {k: getattr(config, k) for k in names if getattr(config, k) != getattr(default, k)}


def default_contenders(config: BenchConfig) -> list[Contender]:
    """HF generate on the AR checkpoint, then the contenders of each group in ``config.contenders``;
    of contenders that come out the same (their names say all they set), the first."""
    groups, length, fallback = config.contenders, config.max_new_tokens, _fallback(config)
    contenders = [Contender("HF generate (AR ckpt)", "hf", "ar")]
    if "hf-mars" in groups:
        contenders.append(Contender("HF generate (MARS ckpt)", "hf", "mars"))
    if "lookup" in groups:
        contenders.append(
            Contender("HF prompt lookup (MARS ckpt)", "hf-lookup", "mars", {"prompt_lookup_num_tokens": 4})
        )
    for tau in config.taus:
        if "none" in groups:
            contenders.append(_mars("none", length, tau=tau, cache="none", **fallback))
        for size in BLOCK_CACHE_SIZES if "block" in groups else ():
            contenders.append(_mars(f"block{size}", length, tau=tau, cache="block", block_cache_size=size))
        if "cursor" in groups:  # the default decoder
            contenders.append(_mars("cursor", length, tau=tau, cache="cursor", **fallback))
        if "cursor-paper" in groups:  # every step reads its masks
            contenders.append(_mars("cursor", length, tau=tau, cache="cursor", **PAPER_RULE))
        if "cursor-adaptive" in groups:  # rows rest from refused masks: what adaptive width saves, and costs
            adaptive = {**PAPER_RULE, "adaptive_width": True}
            contenders.append(_mars("cursor", length, tau=tau, cache="cursor", **adaptive))
        if "cursor-limit" in groups:  # no masks at batch sizes where they cost more than they buy
            limit = {**PAPER_RULE, "mask_batch_limit": "auto"}
            contenders.append(_mars("cursor", length, tau=tau, cache="cursor", **limit))
        if "cursor-auto" in groups:  # both, the default, whatever --adaptive-width and --mask-batch-limit say
            auto = {"adaptive_width": True, "mask_batch_limit": "auto"}
            contenders.append(_mars("cursor", length, tau=tau, cache="cursor", **auto))
        if "hybrid" in groups:  # lossless verification, then tau on the selected group's masks
            contenders.append(_mars("hybrid", length, tau=tau, mode="hybrid", cache="cursor", **fallback))
        if "hybrid-groups" in groups:
            options = dict(mode="hybrid", cache="cursor", draft_groups=True, **fallback)
            contenders.append(_mars("hybrid +groups", length, tau=tau, **options))
    if "lossless" in groups:
        contenders.append(_mars("lossless", length, mode="lossless", cache="cursor", **fallback))
    if "lossless-groups" in groups:
        contenders.append(
            _mars("lossless +groups", length, mode="lossless", cache="cursor", draft_groups=True, **fallback)
        )
    if config.block_size is not None:
        contenders = [_sized(c, config.block_size) if c.kind == "mars" else c for c in contenders]
    if config.compile is not True:  # auto: as a long-lived process would decode (bench times no compile)
        setting = resolve_compile(config.compile, "cursor", resolve_device(config.device))
        contenders = [
            _compile_as(c, setting if c.decoder is not None and c.decoder.cache == "cursor" else False)
            for c in contenders
        ]
    else:
        contenders = [_compile_as(c, False) for c in contenders]
        contenders += [_compiled(c) for c in contenders if c.decoder is not None and c.decoder.cache == "cursor"]
        # HF generate's own compiled decoding: its static cache and torch.compile of its step
        contenders.append(Contender(HF_COMPILED, "hf", "ar", {"compile": True}))
    unique = {}
    for c in contenders + _drafter_contenders(config):
        unique.setdefault(c.name, c)
    return list(unique.values())


def _sized(c: Contender, block_size: int) -> Contender:
    """``c`` reading ``block_size`` masks a step (a draft group as many), named so."""
    params = replace(c.params, block_size=block_size)
    return replace(c, name=f"{c.name} B={block_size}", options={**c.options, "block_size": block_size}, params=params)


def _compile_as(c: Contender, setting) -> Contender:
    """``c`` with its decoder's ``compile`` set to ``setting`` (an HF contender has no decoder)."""
    return c if c.decoder is None else replace(c, decoder=replace(c.decoder, compile=setting))


def _compiled(c: Contender) -> Contender:
    """``c`` with its step compiled (forward.py): the same text, its compile time reported apart."""
    decoder = replace(c.decoder, compile=True)
    return replace(c, name=f"{c.name} compiled", options={**c.options, "compile": True}, decoder=decoder)


def _drafter_contenders(config: BenchConfig) -> list[Contender]:
    """The separate drafter's contenders: marslm's on the MARS checkpoint at each tau (tau 1: plain
    verification), on the AR checkpoint (plain speculative decoding), and HF assisted generation
    with the same K, drafting exactly K tokens every step as marslm's drafter does."""
    groups, length, k = config.contenders, config.max_new_tokens, config.drafting.num_draft_tokens
    drafter_tau = config.drafting.draft_tau
    drafting = {"draft_tau": drafter_tau} if drafter_tau is not None else {}
    by = f" (drafter tau={drafter_tau})" if drafting else ""
    contenders = []
    for tau in config.taus if "draft" in groups else ():
        contenders.append(_drafted(f"draft K={k}{by} -> MARS tau={tau}", length, k, "mars", drafting, tau=tau))
    if "draft-ar" in groups:
        contenders.append(_drafted(f"draft K={k}{by} -> AR", length, k, "ar", drafting))
    if "assisted" in groups:
        # HF reads these from the assistant's generation config (:func:`_hf_keywords`); its default
        # confidence cut-off would end a draft early
        assisted = dict(
            num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0
        )
        contenders.append(Contender(f"HF assisted K={k} (AR ckpt)", "hf-assisted", "ar", assisted))
    return contenders


def _drafted(name: str, max_new_tokens: int, k: int, checkpoint: str, drafting: dict, **options) -> Contender:
    """A contender decoded by marslm's drafter (``k`` drafts per step, ``drafting``: its own tau
    where given) and ``checkpoint`` verifying."""
    # its settings (a drafted step reads every mask); the name is the drafter's
    c = _mars("", max_new_tokens, **PAPER_RULE, **options)
    return replace(
        c, name=name, kind="draft", checkpoint=checkpoint, options={**options, "num_draft_tokens": k, **drafting}
    )
