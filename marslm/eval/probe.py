"""Is MARS fine-tuning learning? Cheap answers in the paper's terms, from teacher-forced forwards.

Held-out items are prompts with reference answers (the original model's greedy answers, from
``marslm distill``). A batch of items goes through the model once, as the training batch
(objective.two_stream_batch: the clean stream, and the masked stream under the training mask),
with no decoding loop. Over answer targets only, that forward gives:

    fidelity     the clean stream's top-1 at t-1 equals the reference token x_t. Teacher-forced
                 greedy decoding: an item whose every token agrees is one that tau = 1 decoding
                 reproduces exactly, and the agreeing prefix is how far tau = 1 decoding follows it.
    offsets      a block's masks stand for one decoding step whose prefix ends at s, the block's
                 first answer position (its start on the grid of B, or the prompt's end inside the
                 first answer block). Offset 0 is the clean output at s-1 predicting x_s (the AR
                 token); offset j = 1..B is the mask at s+j-1 predicting x_{s+j}. Per offset: top-1
                 accuracy against the reference, held-out cross-entropy, and per tau the share with
                 top-1 probability >= tau and the accuracy among those.
    tokens per forward, teacher-forced, B candidates (the AR token and offsets 1..B-1: the
                 authors' sampler does not read the last mask): per block, 1 + the leading
                 candidates that pass, averaged over blocks.
                 paper_tf     pass = top-1 probability >= tau (the paper's acceptance rule)
                 lossless_tf  pass = top-1 equals the clean stream's top-1 for the same token
                              (what self-drafting with verification keeps)

Both are estimates: every block's prefix is the reference, as if every earlier token had been
predicted right, and steps start only where blocks do (decoding starts a step wherever the last
one stopped). The paper reports the same quantity from decoding: ``marslm eval`` measures that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..adapter import placed_masks
from ..chat import IGNORE
from ..decode.params import PROB, one_token
from ..errors import UserError
from ..training.head_loss import logits_at
from .probe_items import ProbeItem
from .probe_report import DEFAULT_TAUS


@dataclass
class Measurements:
    """What the forwards gave, before any averaging (the tests compare it with plain decoding forwards).

    Blocks: one row per answer block of every item; column j is offset j (0: the AR token).
    """

    block_size: int
    item: torch.Tensor  # [blocks] index of the block's item
    start: torch.Tensor  # [blocks] s: the position the block's offset 0 predicts
    valid: torch.Tensor  # [blocks, B+1] the offset predicts a reference token (inside the block and the answer)
    token: torch.Tensor  # [blocks, B+1] top-1
    conf: torch.Tensor  # [blocks, B+1] top-1 probability (float32 softmax, as decoding computes it)
    correct: torch.Tensor  # [blocks, B+1] top-1 equals the reference
    ce: torch.Tensor  # [blocks, B+1] cross-entropy against the reference
    matches_clean: torch.Tensor  # [blocks, B+1] top-1 equals the clean stream's top-1 for the same token
    clean_token: list = field(default_factory=list)  # per item: [answer length] the clean top-1 for each target
    clean_ce: list = field(default_factory=list)  # per item: [answer length]


def _gather(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return values.gather(1, index.clamp(0, values.shape[1] - 1).flatten(1)).view(index.shape)


def _stats(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, ...]:
    """Top-1, its probability and the cross-entropy per kept column, a chunk at a time."""
    from ..decode.acceptance import confidence

    tokens, confs, ces = [], [], []
    for i in range(0, len(logits), chunk):
        part = logits[i : i + chunk]
        tok, conf = confidence(part[None], torch.full((1,), PROB, device=part.device), present={PROB})
        tokens.append(tok[0])
        confs.append(conf[0])
        ces.append(F.cross_entropy(part.float(), targets[i : i + chunk], reduction="none"))
    return torch.cat(tokens), torch.cat(confs), torch.cat(ces)


@dataclass
class _Outputs:
    """One batch's forward, per column: top-1, its probability and the CE against the reference
    (``[rows, T + N]``, zeros where nothing is scored), and where the noisy columns come from."""

    input_ids: torch.Tensor  # [rows, T]
    token: torch.Tensor
    conf: torch.Tensor
    ce: torch.Tensor
    noisy_keep: torch.Tensor | None  # [rows, N] a mask with a reference token after it
    noisy_columns: torch.Tensor | None  # [rows, N] the clean column each noisy column copies

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def _forward(model, items: list[ProbeItem], block_size: int, mask_token_id: int | None, pad_id: int) -> _Outputs:
    """The batch's teacher-forced forward: the clean stream, and the masked one under the training mask.

    No EOS padding to a block multiple, unlike training: a masked position sees nothing after its
    own column, so the padding would change no output the probe scores (its EOS targets are no
    reference's) and would only cost compute.
    """
    from ..masks import for_attention
    from ..training.collate import collate
    from ..training.objective import two_stream_batch

    examples = [
        {"input_ids": it.prompt_ids + it.answer_ids, "labels": [IGNORE] * len(it.prompt_ids) + it.answer_ids}
        for it in items
    ]
    batch = collate(examples, pad_id)  # right padding: real columns never see it, and nothing scores it
    device = next(model.parameters()).device
    input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    # the output at p predicts the token at p + 1
    next_label = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    clean_keep = next_label != IGNORE
    noisy_keep = columns = None
    if mask_token_id is None:
        keep, targets = clean_keep, next_label
        inputs = {"input_ids": input_ids}
    else:
        two = two_stream_batch(input_ids, labels, block_size, mask_token_id)
        columns = two.noisy_columns
        noisy_keep = (columns >= 0) & _gather(clean_keep & (labels != IGNORE), columns)
        keep = torch.cat([clean_keep, noisy_keep], dim=1)
        targets = torch.cat([next_label, torch.where(noisy_keep, _gather(next_label, columns), IGNORE)], dim=1)
        inputs = {
            "input_ids": two.input_ids,
            "position_ids": two.position_ids,
            "attention_mask": for_attention(two.attention_mask, model),
        }
    placed = two.placed_masks if mask_token_id is not None else torch.zeros_like(input_ids, dtype=torch.bool)
    with placed_masks(model, placed):
        stats = _stats(logits_at(model, keep, **inputs), targets[keep])

    def unflatten(values, fill):
        out = torch.full(keep.shape, fill, dtype=values.dtype, device=device)
        out[keep] = values
        return out

    token, conf, ce = (unflatten(v, fill) for v, fill in zip(stats, (-1, 0.0, 0.0)))
    return _Outputs(input_ids, token, conf, ce, noisy_keep, columns)


def _at_clean_positions(out: _Outputs) -> tuple[torch.Tensor, ...]:
    """The masked stream's top-1, probability and CE moved back to the clean columns they copy."""
    w = out.width
    token = torch.full_like(out.token[:, :w], -1)
    conf, ce = torch.zeros_like(out.conf[:, :w]), torch.zeros_like(out.ce[:, :w])
    r_idx, c_idx = out.noisy_keep.nonzero(as_tuple=True)
    p_idx = out.noisy_columns[r_idx, c_idx]
    for dest, src in ((token, out.token), (conf, out.conf), (ce, out.ce)):
        dest[r_idx, p_idx] = src[:, w:][r_idx, c_idx]
    return token, conf, ce


def _blocks(out: _Outputs, prompt_len: torch.Tensor, seq_len: torch.Tensor, block_size: int) -> dict:
    """Per answer block (from the block holding the first answer token to the one holding the
    last), per offset 0..B: what the block's decoding step would see."""
    B, w, device = block_size, out.width, out.input_ids.device
    clean = (out.token[:, :w], out.conf[:, :w], out.ce[:, :w])
    noisy = _at_clean_positions(out)
    first_blk, last_blk = prompt_len // B, (seq_len - 1) // B
    blk = first_blk[:, None] + torch.arange(int((last_blk - first_blk).max()) + 1, device=device)
    has_block = blk <= last_blk[:, None]
    start = torch.maximum(blk * B, prompt_len[:, None])  # s
    offset = torch.arange(B + 1, device=device)
    out_pos = start[..., None] + offset - 1  # [rows, blocks, B+1] the output predicting x_{s+j}
    target_pos = out_pos + 1
    valid = (
        has_block[..., None]
        & (target_pos < seq_len[:, None, None])
        & ((offset == 0) | (out_pos < (blk[..., None] + 1) * B))
    )
    is_clean = offset == 0

    def pick(clean_values, noisy_values):
        return torch.where(is_clean, _gather(clean_values, out_pos), _gather(noisy_values, out_pos))

    token = pick(clean[0], noisy[0])
    reference = _gather(out.input_ids, target_pos)
    measured = {
        "item": torch.arange(len(blk), device=device)[:, None].expand_as(blk)[has_block],
        "start": start[has_block],
        "valid": valid[has_block],
        "token": token[has_block],
        "conf": pick(clean[1], noisy[1])[has_block],
        "correct": (valid & (token == reference))[has_block],
        "ce": pick(clean[2], noisy[2])[has_block],
        "matches_clean": (valid & (token == _gather(clean[0], out_pos)))[has_block],
    }
    return {k: v.cpu() for k, v in measured.items()}


@torch.no_grad()
def _measure_batch(model, items: list[ProbeItem], block_size: int, mask_token_id: int | None, pad_id: int):
    """Per-item clean tensors and per-block tensors for one batch (``mask_token_id`` None: clean only)."""
    out = _forward(model, items, block_size, mask_token_id, pad_id)
    device = out.input_ids.device
    prompt_len = torch.tensor([len(it.prompt_ids) for it in items], device=device)
    seq_len = prompt_len + torch.tensor([len(it.answer_ids) for it in items], device=device)
    answer = [slice(int(p) - 1, int(s) - 1) for p, s in zip(prompt_len, seq_len)]
    clean_token = [out.token[r, answer[r]].cpu() for r in range(len(items))]
    clean_ces = [out.ce[r, answer[r]].cpu() for r in range(len(items))]
    if mask_token_id is None:
        return clean_token, clean_ces, None
    return clean_token, clean_ces, _blocks(out, prompt_len, seq_len, block_size)


def measure(
    model,
    items: list[ProbeItem],
    *,
    block_size: int,
    mask_token_id: int | None,
    pad_id: int = 0,
    batch_size: int = 8,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Measurements:
    """Run the items through ``model`` in batches of similar length. ``mask_token_id`` None: the
    clean stream only (a plain causal forward; a model without a mask token). ``autocast_dtype``:
    run the forward under autocast, as training under ``--bf16`` does."""
    from contextlib import nullcontext

    from tqdm.auto import tqdm

    if batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_ids) + len(items[i].answer_ids))
    clean_token, clean_ce = [None] * len(items), [None] * len(items)
    parts: list[dict] = []
    bar = tqdm(total=len(items), desc="probe", unit="item", disable=not progress, leave=False)
    for lo in range(0, len(order), batch_size):
        index = order[lo : lo + batch_size]
        cast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        with cast:
            tokens, ces, blocks = _measure_batch(model, [items[i] for i in index], block_size, mask_token_id, pad_id)
        for i, tok, ce in zip(index, tokens, ces):
            clean_token[i], clean_ce[i] = tok, ce.float()
        if blocks is not None:
            blocks["item"] = torch.tensor(index)[blocks["item"]]
            parts.append(blocks)
        bar.update(len(index))
    bar.close()
    empty = torch.zeros(0, block_size + 1)
    joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}
    return Measurements(
        block_size=block_size,
        item=joined.get("item", torch.zeros(0, dtype=torch.long)),
        start=joined.get("start", torch.zeros(0, dtype=torch.long)),
        valid=joined.get("valid", empty.bool()),
        token=joined.get("token", empty.long()),
        conf=joined.get("conf", empty).float(),
        correct=joined.get("correct", empty.bool()),
        ce=joined.get("ce", empty).float(),
        matches_clean=joined.get("matches_clean", empty.bool()),
        clean_token=clean_token,
        clean_ce=clean_ce,
    )


def _rate(hits, total) -> float | None:
    return round(float(hits) / float(total), 6) if total else None


def leading_run(passes: torch.Tensor) -> torch.Tensor:
    """``[blocks]``: how many leading candidates pass, left to right, stopping at the first that does not."""
    return passes.int().cumprod(dim=1).sum(dim=1)


def fidelity(items: list[ProbeItem], clean_token: list) -> dict:
    """Clean top-1 agreement with the references: over tokens, per source, and per item."""

    def summary(indices):
        agree = [(clean_token[i] == torch.tensor(items[i].answer_ids)) for i in indices]
        prefix = [int(a.int().cumprod(0).sum()) for a in agree]
        tokens = sum(len(a) for a in agree)
        return {
            "items": len(indices),
            "answer_tokens": tokens,
            "top1_agreement": _rate(sum(int(a.sum()) for a in agree), tokens),
            "items_all_agree": _rate(sum(bool(a.all()) for a in agree), len(indices)),
            "mean_agreeing_prefix": round(sum(prefix) / len(prefix), 3) if prefix else None,
        }

    result = summary(range(len(items)))
    result["by_source"] = {
        source: summary([i for i, it in enumerate(items) if it.source == source])
        for source in sorted({it.source for it in items})
    }
    return result


def summarise(items: list[ProbeItem], m: Measurements, taus=DEFAULT_TAUS) -> dict:
    """The probe's report (module docstring) from a :func:`measure` of a model with masks."""
    B = m.block_size
    answer_tokens = sum(len(it.answer_ids) for it in items)
    offsets = []
    for j in range(B + 1):
        valid, n = m.valid[:, j], int(m.valid[:, j].sum())
        entry = {
            "offset": j,
            "predicts": "x_s (the AR token)" if j == 0 else f"x_s+{j}" + (" (the last mask)" if j == B else ""),
            "n": n,
            "top1_accuracy": _rate(m.correct[:, j].sum(), n),
            "ce": round(float(m.ce[valid, j].mean()), 6) if n else None,
            "confident": {},
        }
        for tau in taus:
            confident = valid & (m.conf[:, j] >= torch.tensor(tau, dtype=m.conf.dtype))
            entry["confident"][f"{tau:g}"] = {
                "share": _rate(confident.sum(), n),
                "precision": _rate((confident & m.correct[:, j]).sum(), confident.sum()),
            }
        offsets.append(entry)

    candidates = m.valid[:, 1:B]  # the paper's B candidates: the AR token and the first B-1 masks
    paper = {}
    for tau in taus:
        if one_token(tau, "prob"):  # one-token mode (the probe reads prob): no mask passes, even at 1.0
            run = torch.zeros(len(m.valid), dtype=torch.long)
        else:
            run = leading_run(candidates & (m.conf[:, 1:B] >= torch.tensor(tau, dtype=m.conf.dtype)))
        paper[f"{tau:g}"] = round(float((1 + run).float().mean()), 4) if len(run) else None
    lossless = leading_run(candidates & m.matches_clean[:, 1:B])
    masks = m.valid[:, 1:]
    clean_ce = torch.cat(m.clean_ce) if m.clean_ce else torch.zeros(0)
    return {
        "items": len(items),
        "answer_tokens": answer_tokens,
        "blocks": len(m.valid),
        "block_size": B,
        "taus": list(taus),
        "fidelity": fidelity(items, m.clean_token),
        "clean_ce": round(float(clean_ce.mean()), 6) if len(clean_ce) else None,
        "masked_ce": round(float(m.ce[:, 1:][masks].mean()), 6) if masks.any() else None,
        "offsets": offsets,
        "tokens_per_forward_paper_tf": paper,
        "tokens_per_forward_lossless_tf": round(float((1 + lossless).float().mean()), 4) if len(lossless) else None,
    }


def probe(
    model,
    items: list[ProbeItem],
    *,
    block_size: int,
    mask_token_id: int,
    taus=DEFAULT_TAUS,
    pad_id: int = 0,
    batch_size: int = 8,
    progress: bool = False,
) -> dict:
    """:func:`summarise` of :func:`measure`, with the seconds it took."""
    started = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        m = measure(
            model,
            items,
            block_size=block_size,
            mask_token_id=mask_token_id,
            pad_id=pad_id,
            batch_size=batch_size,
            progress=progress,
        )
    finally:
        model.train(was_training)
    return {**summarise(items, m, taus), "seconds": round(time.perf_counter() - started, 2)}


def probe_clean(
    model,
    items: list[ProbeItem],
    *,
    pad_id: int = 0,
    batch_size: int = 8,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> dict:
    """Fidelity alone, from plain causal forwards: for a model without a mask token (the original)."""
    started = time.perf_counter()
    m = measure(
        model,
        items,
        block_size=1,
        mask_token_id=None,
        pad_id=pad_id,
        batch_size=batch_size,
        autocast_dtype=autocast_dtype,
        progress=progress,
    )
    return {"fidelity": fidelity(items, m.clean_token), "seconds": round(time.perf_counter() - started, 2)}
