"""A separate draft model in the server (``marslm serve --draft-model``): one request at a time.

draft_model.py's composition drafts for one row, so a drafted server decodes its requests one
after another: its decoder is a ``DraftedBatch`` (one row at a time, behind the interface every
decoder shares, built by decoder.make_decoder as generate's is). The engine's turn, its
publishing, stop strings, cancellation, deadlines and metrics are then the same code for drafted
requests as for batched ones.

The drafter is checked once, at start (its vocabulary against the target's); each request is
checked as it arrives: threshold mode only, with check_drafter's words.
"""

from __future__ import annotations

from ..decode.draft_model import check_draft_settings, check_drafting, drafter_for
from ..decode.params import DecoderOptions, DecodingParams, ParamError
from ..errors import UserError
from .config import ServeConfig, refuse_with_drafter


def served_drafter(target, drafting: dict | None, config: ServeConfig, decoder: DecoderOptions, mask_token_id):
    """``(what make_decoder takes as a drafted server's drafting, what /v1/models says of its
    drafter)``, or ``(None, None)`` without a drafter. ``drafting``: ``generate``'s drafter keywords
    (``DraftOptions.load``), checked against ``target`` ``(model, tokenizer)`` and its mask token."""
    if not drafting:
        return None, None
    refuse_with_drafter(config)
    model, k = drafting["draft_model"], drafting["num_draft_tokens"]
    options = model, drafting.get("draft_tokenizer"), k, drafting.get("draft_tau")
    check_drafting(options)
    drafter = drafter_for(target, options, mask_token_id, decoder.use_last_mask)
    return (drafter, k, mask_token_id), drafter_card(drafter, k, config.drafting.draft_model)


def drafter_card(drafter, k: int, path: str | None) -> dict:
    """What /v1/models and /metrics say of the drafter: its checkpoint (``path``, else the name
    it was loaded under), drafts per step and its own tau (None: an AR drafter)."""
    name = path or getattr(drafter.model.config, "_name_or_path", None) or "draft model"
    return {"model": name, "num_draft_tokens": k, "draft_tau": getattr(drafter, "tau", None)}


def check_drafted_request(settings: DecodingParams) -> None:
    """A request a drafted server runs: threshold mode (its stop strings the engine matches)."""
    try:
        check_draft_settings(settings, DecoderOptions())
    except UserError as exc:
        raise ParamError(str(exc), "mode") from None
