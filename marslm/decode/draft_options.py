"""A separate drafter's two settings (the paper's section 4.6), declared once for every command
that takes one: ``marslm generate``, ``eval``, ``bench`` and ``serve``. Torch-free, so parsers can read it;
the decoding is draft_model.py's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UserError
from ..settings import check_count, flag_of, setting
from .params import DEFAULT_DRAFT_TAU, MAX_DRAFT_TOKENS, check_draft_tau

DRAFT_TOKENS = 4  # drafts per step when not told


@dataclass(frozen=True)
class DraftOptions:
    """A draft model and how many tokens it proposes per step; checked when made."""

    draft_model: str | None = setting(
        None, "an AR or MARS model of the same vocabulary drafting for the model (checkpoint directory)", metavar="PATH"
    )
    num_draft_tokens: int = setting(DRAFT_TOKENS, "drafts per step, with --draft-model", metavar="K")
    draft_tau: float | None = setting(
        None,
        "a MARS drafter's threshold: it drafts its masks' predictions while their top-1 probability "
        f"passes it (default {DEFAULT_DRAFT_TAU}; refused for an AR drafter)",
        metavar="TAU",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.draft_model is None:
            # a drafter's settings without a drafter would do nothing
            for name, idle in (
                ("draft_tau", self.draft_tau is not None),
                ("num_draft_tokens", self.num_draft_tokens != DRAFT_TOKENS),
            ):
                if idle:
                    raise UserError(f"{flag_of(DraftOptions, name)} needs {flag_of(DraftOptions, 'draft_model')}")
            return
        check_count(flag_of(DraftOptions, "num_draft_tokens"), self.num_draft_tokens, MAX_DRAFT_TOKENS)
        if self.draft_tau is not None:
            check_draft_tau(self.draft_tau)

    def recorded(self) -> dict:
        """The settings as a report records them: none without a drafter, so undrafted records
        keep the keys they had before drafters."""
        return {} if self.draft_model is None else asdict(self)

    def load(self, device: str | None = "auto", dtype: str | None = None) -> dict:
        """``generate``'s drafting keywords (none without a drafter): the draft model and its
        tokenizer, which ``generate`` checks against the target's, and the drafts per step."""
        if self.draft_model is None:
            return {}
        from ..modeling import load_model, resolve_device

        model, tokenizer, _ = load_model(self.draft_model, dtype=dtype, device=resolve_device(device))
        return dict(
            draft_model=model,
            draft_tokenizer=tokenizer,
            num_draft_tokens=self.num_draft_tokens,
            draft_tau=self.draft_tau,
        )
