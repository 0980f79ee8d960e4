"""A separate draft model in the server (``marslm serve --draft-model``): one request at a time.

draft_model.py's composition drafts for one row, so a drafted server decodes its requests one
after another: ``DraftedBatch`` holds at most one row, a ``DraftedRow``, and answers the engine
as a ``DecodeBatch`` does (``add``, ``step``, ``new_tokens``, ``stop``, ``cancel``, ``set_tau``).
The engine's turn, its publishing, stop strings, cancellation, deadlines and metrics are then the
same code for drafted requests as for batched ones; each turn is one ``DraftedRow.step()``.

The drafter is checked once, at start (its vocabulary against the target's); each request is
checked as it arrives: threshold mode only, with check_drafter's words.
"""

from __future__ import annotations

from dataclasses import replace

from ..decode.draft_model import DraftModelDecoder, check_draft_settings, check_drafting, drafter_for
from ..decode.params import DecoderOptions, DecodingParams, ParamError
from ..decode.rows import FinishedRow
from ..errors import UserError
from .config import ServeConfig, refuse_with_drafter


def served_drafter(target, drafting: dict | None, config: ServeConfig, decoder: DecoderOptions, facts: dict):
    """``(the decoder of a drafted server, what /v1/models says of its drafter)``, or ``(None,
    None)`` without a drafter. ``drafting``: ``generate``'s drafter keywords (``DraftOptions.load``),
    checked against ``target`` ``(model, tokenizer)``; ``facts``: the target's mask and stop ids,
    and the seed of the requests that name none."""
    if not drafting:
        return None, None
    refuse_with_drafter(config)
    model, k = drafting["draft_model"], drafting["num_draft_tokens"]
    options = model, drafting.get("draft_tokenizer"), k, drafting.get("draft_tau")
    check_drafting(options)
    drafter = drafter_for(target, options, facts["mask_token_id"], decoder.use_last_mask)
    decoding = DraftModelDecoder(
        target[0],
        drafter,
        k,
        mask_token_id=facts["mask_token_id"],
        stop_ids=facts["stop_ids"],
        use_last_mask=decoder.use_last_mask,
        seed=facts["seed"],
    )
    return decoding, drafter_card(decoding, config.drafting.draft_model)


def drafter_card(decoding: DraftModelDecoder, path: str | None) -> dict:
    """What /v1/models and /metrics say of the drafter: its checkpoint (``path``, else the name
    it was loaded under), drafts per step and its own tau (None: an AR drafter)."""
    name = path or getattr(decoding.drafter.model.config, "_name_or_path", None) or "draft model"
    return {"model": name, "num_draft_tokens": decoding.k, "draft_tau": getattr(decoding.drafter, "tau", None)}


def check_drafted_request(settings: DecodingParams) -> None:
    """A request a drafted server runs: threshold mode (its stop strings the engine matches)."""
    try:
        check_draft_settings(settings, DecoderOptions(), stop_strings=True)
    except UserError as exc:
        raise ParamError(str(exc), "mode") from None


class DraftedBatch:
    """At most one drafted row, behind a ``DecodeBatch``'s interface (``mask_batch_limit`` and the
    masked-step counts stay unset: a drafted server refuses ``--mask-batch-limit``).

    Requests that name no seed sample with the server's ``seed`` (``served_drafter``) and a count,
    as a batch's do (draws.py)."""

    mask_batch_limit = None

    def __init__(self, decoding: DraftModelDecoder):
        self.decoding, self.stats = decoding, decoding.stats
        self.row = None
        self.last: list[int] = []  # what the last step added to the running row's answer

    def __len__(self) -> int:
        return int(self.row is not None)

    def add(self, prompts: list[list[int]], settings: list[DecodingParams], request_ids: list) -> None:
        if not prompts:
            return
        if len(self) + len(prompts) > 1:
            raise ValueError("a drafted batch decodes one request at a time")
        params = replace(settings[0])  # set_tau replaces it; the request's own stays as it was
        self.row, self.last = self.decoding.start_row(prompts[0], params, request_ids[0]), []

    def step(self) -> list[FinishedRow]:
        if self.row is None:
            return []
        self.last = self.row.step()
        return self._pop() if self.row.finished else []

    def new_tokens(self) -> dict:
        """The running row's tokens of the last step (a row that finished is reported by ``step``)."""
        return {self.row.request_id: list(self.last)} if self.row is not None and self.last else {}

    def stop(self, request_ids) -> list[FinishedRow]:
        """End the row now (a stop string matched): its tokens so far."""
        return self._pop() if self._holds(request_ids) else []

    def cancel(self, request_ids) -> None:
        if self._holds(request_ids):
            self._pop()

    def set_tau(self, request_ids, tau: float) -> None:
        if self._holds(request_ids):
            self.row.params = replace(self.row.params, tau=tau)

    def _holds(self, request_ids) -> bool:
        return self.row is not None and self.row.request_id in set(request_ids)

    def _pop(self) -> list[FinishedRow]:
        finished, self.row, self.last = self.row.result(), None, []
        return [finished]
