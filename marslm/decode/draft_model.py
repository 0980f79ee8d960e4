"""Speculative decoding with a separate draft model, composed with MARS (the paper, section 4.6).

Each step, one row at a time:

    draft    the drafter (drafters.py; its own KV cache) proposes K tokens: an AR model one per
             forward, a MARS model several, its confident masks under its own tau
    verify   one target forward over [pending | K drafts | K + 1 groups of masks]; group g sits
             after draft g and sees the prefix and drafts 1..g (masks.py's group layout)
    accept   the drafts the target confirms (greedy: equal to its argmax; sampling: equal to its
             race winner at that position, draws.py, exact), then the target's token after them;
             then, from group j (j drafts kept), a confident left-to-right prefix of its mask
             predictions under the row's tau
    commit   both caches keep only the accepted tokens: the target drops masks and rejected
             drafts, the drafter crops back to the longest prefix it shares with the output

At tau 1, or with a target that has no mask token, no masks are fed: plain speculative decoding,
whose output is the target's (greedy token for token, or in distribution). Rows decode one after
another (batch size 1 per row): a ``DraftedRow`` is one row's state, one step per ``step()``;
``DraftedBatch`` holds at most one of them behind the interface every decoder shares (decoder.py),
so ``generate`` and the server (marslm/serve/drafting.py) step it as they step any batch.
Before any decoding, ``check_drafter`` refuses a drafter of another vocabulary and the settings
this loop does not run (other modes, the block cache). Stop strings are matched on the text by
whoever steps the decoder, as for any other (generation.py, the server's engine).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from transformers import DynamicCache

from ..adapter import placed_masks
from ..errors import UserError
from ..masks import decode_step_mask, for_attention
from ..settings import check_count
from .drafters import ARDrafter, MarsDrafter, confident_masks, crop_to, probs
from .draws import RowDraws
from .params import DEFAULT_DRAFT_TAU, MAX_DRAFT_TOKENS, DecodingParams, check_draft_tau
from .rows import BatchStats, FinishedRow
from .rules import cut_at_stop, verify_drafts


def check_drafter(params: DecodingParams, decoder, target, drafting, mask_token_id) -> ARDrafter:
    """Refuse, before decoding, what this decoder cannot run; return the drafter. ``target`` is
    ``(model, tokenizer)``, ``drafting`` ``(draft model or None, its tokenizer or None, drafts per
    step, draft tau or None)``."""
    check_drafting(drafting)
    check_draft_settings(params, decoder)
    return drafter_for(target, drafting, mask_token_id, decoder.use_last_mask)


def check_drafting(drafting) -> None:
    """A draft model is given, and a number of drafts per step in range."""
    draft_model, _, k, _ = drafting
    if draft_model is None:
        raise UserError("draft_tau is a draft model's threshold; no draft model was given")
    check_count("num_draft_tokens", k, MAX_DRAFT_TOKENS)


def check_draft_settings(params: DecodingParams, decoder) -> None:
    """Refuse the settings this loop does not run: other modes, the block cache."""
    # the drafted loop keeps both caches itself: another cache policy would be ignored
    if params.mode != "threshold" or decoder.cache != "cursor":
        raise UserError("a draft model decodes in threshold mode with the cursor cache")


def drafter_for(target, drafting, mask_token_id, use_last_mask: bool) -> ARDrafter:
    """The drafter of ``drafting``, its vocabulary checked against the target's."""
    draft_model, draft_tokenizer, _, draft_tau = drafting
    check_drafter_vocabulary(target, (draft_model, draft_tokenizer), mask_token_id)
    return make_drafter((draft_model, draft_tokenizer), target[1], draft_tau, use_last_mask)


def make_drafter(drafter, tokenizer, draft_tau, use_last_mask: bool) -> ARDrafter:
    """A MARS drafter where the draft model has a mask token (``drafter_mask_token``), else an AR
    drafter, which takes no tau."""
    from ..modeling import checkpoint_facts

    model, draft_tokenizer = drafter
    facts = checkpoint_facts(model, draft_tokenizer if draft_tokenizer is not None else tokenizer)
    mask_token_id = drafter_mask_token(model, facts)
    if mask_token_id is None:
        if draft_tau is not None:
            raise UserError("draft_tau is a MARS drafter's; this draft model is an AR model (one draft per forward)")
        return ARDrafter(model)
    tau = DEFAULT_DRAFT_TAU if draft_tau is None else draft_tau
    check_draft_tau(tau)
    return MarsDrafter(model, mask_token_id, tau, facts.block_size - 1 + use_last_mask)


def drafter_mask_token(model, facts) -> int | None:
    """The mask token a draft model drafts with: its checkpoint facts' (read with its tokenizer, else
    the target's, which it shares). None for an AR-stage checkpoint, whose masks never trained, and
    for a token outside its embedding (the target's own, which its MARS training added)."""
    from ..adapter import adapter_of

    if facts.mask_token_id is None or facts.stage == "ar":
        return None
    rows = model.get_input_embeddings().weight.shape[0]
    # an exact checkpoint's adapter embeds its mask itself, also at an id past the rows
    return facts.mask_token_id if facts.mask_token_id < rows or adapter_of(model) is not None else None


def check_drafter_vocabulary(target, drafter, mask_token_id) -> None:
    """Drafts are token ids fed to the target: the drafter must mean the same tokens by them.

    The drafter scores as many ids as the target, or fewer only where the target grew rows for its
    mask token (a MARS target's, past the drafter's rows) and it still covers every token of the
    target's tokenizer; a given drafter tokenizer must map each token as the target's does (the
    mask token aside).
    """
    (model, tokenizer), (draft_model, draft_tokenizer) = target, drafter
    vocab = {t: i for t, i in tokenizer.get_vocab().items() if i != mask_token_id}
    needed, rows, target_rows = max(vocab.values()) + 1, output_rows(draft_model), output_rows(model)
    grown_for_mask = mask_token_id is not None and rows <= mask_token_id < target_rows
    if not (rows == target_rows or (grown_for_mask and needed <= rows)):
        raise UserError(
            f"the draft model's vocabulary ({rows} rows) differs from the target's ({needed} tokens, "
            f"{target_rows} rows); a drafter must share its tokenizer"
        )
    if draft_tokenizer is not None:
        draft_vocab = {t: i for t, i in draft_tokenizer.get_vocab().items() if i != mask_token_id}
        if draft_vocab != vocab:
            raise UserError(
                "the draft model's tokenizer differs from the target's; a drafter must share its vocabulary"
            )


def output_rows(model) -> int:
    """The number of token ids a model scores (its output embedding's rows)."""
    return model.get_output_embeddings().weight.shape[0]


class DraftModelDecoder:
    """Decodes rows with ``drafter`` proposing ``num_draft_tokens`` per step and ``model`` verifying.
    Rows that name no seed sample with ``seed`` and a count, as a batch's do (draws.py)."""

    def __init__(
        self, model, drafter: ARDrafter, num_draft_tokens: int, *, mask_token_id, stop_ids, use_last_mask, seed=None
    ):
        self.model, self.drafter, self.k = model, drafter, num_draft_tokens
        self.device = next(model.parameters()).device
        self.draws = RowDraws(self.device, seed)
        self.mask_token_id = mask_token_id  # None: an AR target, plain speculative decoding
        self.stop_ids = np.array(stop_ids, dtype=np.int64)
        self.use_last_mask = use_last_mask
        self.stats = BatchStats()

    def start_row(self, prompt: list[int], params: DecodingParams, request_id) -> DraftedRow:
        """A row to decode a step at a time (:class:`DraftedRow`)."""
        return DraftedRow(self, prompt, params, request_id)

    @torch.no_grad()
    def run_row(self, prompt: list[int], params: DecodingParams, request_id) -> FinishedRow:
        row = self.start_row(prompt, params, request_id)
        while not row.finished:
            row.step()
        return row.result()

    def n_masks(self, params: DecodingParams) -> int:
        """Masks per group of a verify forward: none for an AR target or at one-token settings."""
        if self.mask_token_id is None or params.one_token:
            return 0
        return params.block_size - 1 + self.use_last_mask

    def _verify_forward(self, cache, pending, cached, length, drafts, n_masks):
        """Logits at the last pending token, each draft and every mask: ``[K + 1 + (K + 1) * masks, vocab]``."""
        k, groups = len(drafts), len(drafts) + 1 if n_masks else 1
        sees = np.arange(groups)[None] if n_masks else np.array([[k]])
        input_ids = pending + drafts + [self.mask_token_id] * (groups * n_masks)
        positions = list(range(cached, length)) + list(range(length, length + k))
        positions += [length + g + c for g in range(groups) for c in range(n_masks)]
        real, valid = np.ones((1, len(pending) + k), bool), np.ones((1, groups), bool)
        mask = decode_step_mask(np.ones((1, cached), bool), real, len(pending) + sees, valid, n_masks)
        with placed_masks(self.model, [[False] * (len(pending) + k) + [True] * (groups * n_masks)]):
            logits = self.model(
                input_ids=torch.tensor([input_ids], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                attention_mask=for_attention(torch.from_numpy(mask).to(self.device), self.model),
                cache=cache,
                use_cache=True,
            ).logits[0]
        return logits[len(pending) - 1 :]

    def _accept(self, logits, drafts, n_masks, params: DecodingParams, race, position: int):
        """The step's tokens (kept drafts, the target's token, group j's confident masks) and how
        many drafts were kept. The target's outputs are its argmax, or sampling its race winners
        from ``position`` on (``race(probs, positions)``, draws.py)."""
        k = len(drafts)
        if params.temperature > 0:
            ar = race(probs(logits[: k + 1], params, self.device), range(position, position + k + 1))
        else:
            ar = logits[: k + 1].argmax(-1)
        draft = np.array([drafts], np.int64).reshape(1, k)
        kept, correction = verify_drafts(ar.cpu().numpy()[None], draft, np.ones(draft.shape, bool))
        kept = int(kept[0])
        tokens = drafts[:kept] + [int(correction[0])]
        if n_masks:  # group j = kept sits after the kept drafts: its masks follow the target's token
            group = logits[k + 1 + kept * n_masks : k + 1 + (kept + 1) * n_masks]
            tokens += confident_masks(group, params.tau, params.metric)
        return tokens, kept


class DraftedRow:
    """One row of a :class:`DraftModelDecoder`, decoded a step at a time: ``run_row`` steps it to
    the end, the server one step per engine turn. The decoder's drafter keeps one row's cache, so
    one row decodes at a time: starting a row resets the drafter.

    The row samples with its own seed, else with the decoder's and a count (draws.py).
    ``params`` is read at every step, so a new tau (the server's default, moved) applies from the next.
    """

    def __init__(self, decoder: DraftModelDecoder, prompt: list[int], params: DecodingParams, request_id):
        self.decoder, self.params, self.request_id = decoder, params, request_id
        self.seed = int(decoder.draws.row_seeds([params.seed])[0])
        decoder.drafter.reset()
        self.prompt_len, self.ids = len(prompt), list(prompt)
        self.cache, self.cached = DynamicCache(), 0  # the target's keys/values of ids[:cached]
        self.accepted_per_step: list[int] = []
        self.stopped = False  # ended on a stop token

    @property
    def finished(self) -> bool:
        return self.stopped or len(self.ids) - self.prompt_len >= self.params.max_new_tokens

    @torch.no_grad()
    def step(self) -> list[int]:
        """Draft, verify, accept, commit; return the tokens this step added to the answer (a stop
        token is the row's end, not part of its answer)."""
        d, params, ids = self.decoder, self.params, self.ids
        room = params.max_new_tokens - (len(ids) - self.prompt_len)
        k, n_masks = min(d.k, room - 1), d.n_masks(params)
        drafts = d.drafter.propose(ids, k, params, self._race) if k > 0 else []
        logits = d._verify_forward(self.cache, ids[self.cached :], self.cached, len(ids), drafts, n_masks)
        d.stats.forwards += 1
        tokens, kept = d._accept(logits, drafts, n_masks, params, self._race, len(ids))
        accept, stop = cut_at_stop(np.array([tokens]), np.array([min(len(tokens), room)]), d.stop_ids)
        accept, self.stopped = int(accept[0]), bool(stop[0])
        self.cached = len(ids) + min(kept, accept)  # pending and the accepted drafts; no masks
        crop_to(self.cache, self.cached)
        ids += tokens[:accept]
        self.accepted_per_step.append(accept)
        d.stats.drafter_forwards = d.drafter.forwards
        return tokens[: accept - self.stopped]

    def _race(self, probs: torch.Tensor, positions) -> torch.Tensor:
        """Drafter and target draw the token at a position with the same noise (draws.py), over the
        target's ids: a drafter that scores fewer (check_drafter_vocabulary) gives the rest 0."""
        probs = torch.nn.functional.pad(probs, (0, output_rows(self.decoder.model) - probs.shape[-1]))
        return self.decoder.draws.race(probs, self.seed, positions)

    def result(self) -> FinishedRow:
        """The row as it stands: its answer so far (the stop token excluded) and its steps."""
        new = self.ids[self.prompt_len :]
        answer = new[:-1] if self.stopped else new
        return FinishedRow(self.request_id, answer, self.stopped, self.accepted_per_step, None)


class DraftedBatch:
    """At most one drafted row behind the interface every decoder shares (decoder.py): each
    :meth:`step` is one ``DraftedRow.step()``. The masked-step counts stay unset and no batch limit
    applies: the batch holds one row."""

    joins_running = True
    max_rows = 1  # the drafter keeps one row's cache
    mask_batch_limit = None

    def __init__(self, decoding: DraftModelDecoder):
        self.decoding, self.stats = decoding, decoding.stats
        self.row: DraftedRow | None = None
        self.last: list[int] = []  # what the last step added to the running row's answer

    @classmethod
    def of(cls, model, drafting: tuple, *, stop_ids, use_last_mask: bool, seed=None) -> DraftedBatch:
        """``model`` verifying ``drafting``'s ``(checked drafter, drafts per step, the target's
        mask token or None)``; rows that name no seed sample with ``seed``."""
        drafter, k, mask_token_id = drafting
        options = dict(mask_token_id=mask_token_id, stop_ids=stop_ids, use_last_mask=use_last_mask, seed=seed)
        return cls(DraftModelDecoder(model, drafter, k, **options))

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
