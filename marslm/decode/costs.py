"""What a forward costs against the tokens it feeds: whether a step with masks pays on this machine.

``cost_curve`` times one cached forward per width, batch size and context (``marslm bench
--cost-curve`` prints it); ``MaskBatchLimit`` turns it into ``mask_batch_limit="auto"`` (``marslm
serve``, ``marslm.generate`` and the commands that decode with it): masks are read at a batch size
while the tokens per row a masked step has been buying exceed what such a step costs there, as a
ratio to a one-token step. :func:`measured_mask_limit` times those costs once per model.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch

from ..adapter import adapter_of

log = logging.getLogger("marslm.decode")

# Where a model keeps its measured step costs, by (block size, batch sizes): decoding calls that
# share a model (repeated generate() calls, bench's repeats, an eval sweep's cells) time them once.
STEP_COSTS_ATTR = "_marslm_masked_step_costs"
# And its auto limits, by the same key and a workload (what decides what masks buy: mode, tau...):
# calls of one workload go on learning in one limit, as a server's one limit does across requests,
# so that a loop of short calls neither relearns from a guess nor probes at the start of each.
LIMITS_ATTR = "_marslm_mask_limits"


def cost_curve(
    model, *, widths, contexts=(128, 512), batch_sizes=(1,), repeats: int = 5, seed: int = 0, progress: bool = True
) -> dict:
    """Time of one cached forward against the number of tokens it feeds, as ratios to one token.

    A MARS step feeds the tokens accepted last step plus the masks (up to 2B + 2 columns with
    draft groups), where AR decoding feeds one; what that costs decides whether multi-token
    acceptance pays on a given machine. For each batch size and context length a cache is
    prefilled with ``context`` random tokens, then every width is fed on top of it and the cache
    is cropped back, the widths in turn within each repeat (interleaved), after a warm-up round.
    Logits are computed for every fed column, as a MARS step reads them. On an exact-mode model
    every fed column after the first is the mask token, so that the adapter, which acts at masks
    alone (adapter.py), costs what it does in a step.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    adapter = adapter_of(model)
    mask_id = None if adapter is None else adapter.spec.mask_token_id
    rows = []
    bar = tqdm(
        total=len(batch_sizes) * len(contexts) * (repeats + 1) * len(widths), desc="cost curve", disable=not progress
    )
    for batch in batch_sizes:
        for context in contexts:
            times = _timed_widths(model, batch, context, widths, repeats, generator, mask_id, bar.update)
            base = statistics.median(times[widths[0]])
            for w in widths:
                ms = statistics.median(times[w])
                rows.append({"batch_size": batch, "context": context, "width": w, "ms": 1000 * ms, "ratio": ms / base})
    bar.close()
    return {
        "model": getattr(model, "name_or_path", ""),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "widths": list(widths),
        "rows": rows,
    }


def _timed_widths(model, batch, context, widths, repeats, generator, mask_id, tick) -> dict[int, list[float]]:
    """Seconds of each width's forward over ``repeats`` rounds (after a warm-up round) on a cache of
    ``context`` random tokens; every column after the first is ``mask_id`` where given."""
    from transformers import DynamicCache

    device, vocab = next(model.parameters()).device, model.config.vocab_size
    cache = DynamicCache(config=model.config)
    prefix = torch.randint(vocab, (batch, context), generator=generator).to(device)
    with torch.no_grad():
        model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
    times = {w: [] for w in widths}
    for round_ in range(repeats + 1):  # round 0: warm-up
        for w in widths:
            fed = torch.randint(vocab, (batch, w), generator=generator).to(device)
            if mask_id is not None:
                fed[:, 1:] = mask_id
            positions = (context + torch.arange(w, device=device)).expand(batch, -1)
            _synchronize(device)
            started = time.perf_counter()
            with torch.no_grad():
                model(input_ids=fed, position_ids=positions, cache=cache, use_cache=True)
            _synchronize(device)
            if round_:
                times[w].append(time.perf_counter() - started)
            cache.crop(-w)
            tick(1)
    return times


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def masked_step_costs(model, n_masks: int, batch_sizes, context: int = 64, repeats: int = 3) -> dict[int, float]:
    """Per batch size, a masked step's forward time as a ratio to a one-token step's: a row feeds
    its last accepted tokens (about two) and ``n_masks`` masks where AR feeds one token."""
    report = cost_curve(
        model, widths=(1, n_masks + 2), contexts=(context,), batch_sizes=batch_sizes, repeats=repeats, progress=False
    )
    return {r["batch_size"]: r["ratio"] for r in report["rows"] if r["width"] != 1}


def limit_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a mask batch limit is measured at: the powers of two below ``max_batch``, and it."""
    return tuple(sorted({*(2**i for i in range(max_batch.bit_length())), max_batch}))


def measured_mask_limit(model, block_size: int, max_batch: int, workload: tuple = ()) -> MaskBatchLimit:
    """``mask_batch_limit="auto"``: the model's :class:`MaskBatchLimit` for this block size, the
    batch sizes of :func:`limit_batch_sizes` and ``workload``, made the first time and kept on the
    model for the next call; over a masked step timed against a one-token step at each of those
    batch sizes, once per model, block size and batch sizes."""
    sizes = limit_batch_sizes(max_batch)
    measured = vars(model).setdefault(STEP_COSTS_ATTR, {})
    if (block_size, sizes) not in measured:
        costs = masked_step_costs(model, block_size, sizes)
        measured[block_size, sizes] = costs
        log.info(
            "mask batch limit auto: masked step cost %s; limit %d",
            ", ".join(f"{b}: {c:.2f}x" for b, c in costs.items()),
            MaskBatchLimit(costs).limit,
        )
    limits = vars(model).setdefault(LIMITS_ATTR, {})
    key = (block_size, sizes, *workload)
    if key not in limits:
        limits[key] = MaskBatchLimit(measured[block_size, sizes], most=2 * block_size + 1)
    return limits[key]


# Above the limit a step still reads masks now and then (a probe, MaskBatchLimit.probe_wait), so that
# what they buy keeps being observed and a turn to text they predict well turns them back on: at
# most one step in PROBE_EVERY, and probes' premium at most PROBE_SHARE of the time masks rest.
PROBE_EVERY = 16
PROBE_SHARE = 1 / 32
PROBE_STEPS = 2  # a drafting row's drafts pay in the step after its masks
PRIOR_WEIGHT = 4  # observations the prior counts as


class MaskBatchLimit:
    """The largest batch size at which masks pay, from measured step costs and what masks buy.

    ``step_cost[b]``: a masked step's cost at batch size b, as a ratio to a one-token step. A
    masked step gives each row ``bought`` tokens on average (resting rows included: they pay the
    step's width too), a running mean over recent masked steps that starts at ``prior``, which
    weighs as ``PRIOR_WEIGHT`` observations: the first steps move it, one of them alone does not.
    Masks pay at b while ``bought > step_cost[b]``; the limit is the largest measured b where they
    do, and 0 (no row reads masks) where they pay at none.

    Above the limit nothing would be observed, so a prior or a noisy cost could keep masks off
    for good where they pay. So a batch larger than the limit still reads them in a probe of
    ``PROBE_STEPS`` steps: at once while this limit has observed nothing (its prior is a guess),
    then after each :meth:`probe_wait` steps without masks. Two steps, because a drafting row's
    first masked step only drafts (DecodeBatch counts it nowhere) and what its drafts buy shows in
    the next.
    No probe where a masked step costs ``most`` one-token steps or more: the most tokens a masked
    step can give a row (2B + 1: its drafts, the AR token and a group of masks) would not pay for it.
    """

    def __init__(self, step_cost: dict[int, float], prior: float = 1.5, weight: float = 0.05, most: float = math.inf):
        self.step_cost = dict(sorted(step_cost.items()))
        self.most = most
        self.bought = prior
        self.weight = weight
        self.observed = 0  # masked steps that observed rows
        # the prior is a guess: a batch above its limit is probed at once, then after each wait
        self.steps_without_masks = math.inf
        self._probe_steps = 0  # steps of the probe under way, 0 when none is

    def observe(self, rows: int, tokens: int) -> None:
        """A step that fed masks: ``rows`` rows accepted ``tokens`` tokens."""
        if rows:
            self.observed += 1
            weight = max(self.weight, 1 / (self.observed + PRIOR_WEIGHT))
            self.bought += weight * (tokens / rows - self.bought)

    @property
    def limit(self) -> int:
        paying = [b for b, cost in self.step_cost.items() if cost < self.bought]
        return max(paying, default=0)

    def cost_at(self, rows: int) -> float:
        """The measured cost at the smallest measured batch size of at least ``rows`` (above them
        all, the largest's)."""
        return next((c for b, c in self.step_cost.items() if b >= rows), list(self.step_cost.values())[-1])

    def probe_wait(self, rows: int) -> int:
        """Steps without masks before a probe of ``rows`` rows: at least ``PROBE_EVERY``, and enough
        that the probe's premium over one-token steps is at most ``PROBE_SHARE`` of their time."""
        return max(PROBE_EVERY, math.ceil(PROBE_STEPS * (self.cost_at(rows) - 1) / PROBE_SHARE))

    def next_limit(self, rows: int) -> int:
        """The limit for the next step of ``rows`` rows: :attr:`limit`, or ``rows`` in a probe."""
        limit = self.limit
        if rows <= limit:
            self._probe_steps = 0
            return limit
        waited = self.steps_without_masks >= self.probe_wait(rows) and self.cost_at(rows) < self.most
        if self._probe_steps < PROBE_STEPS and (self._probe_steps or waited):
            self._probe_steps += 1
            return rows
        if self._probe_steps:  # a probe ended: the wait starts over
            self._probe_steps = self.steps_without_masks = 0
        return limit

    def step(self, batch) -> list:
        """One step of a ``DecodeBatch`` under the limit as it stands, then what its masks bought
        observed; returns the rows that finished."""
        stats = batch.stats
        before = stats.masked_row_steps, stats.masked_row_tokens
        batch.mask_batch_limit = self.next_limit(len(batch))
        finished = batch.step()
        rows = stats.masked_row_steps - before[0]
        self.observe(rows, stats.masked_row_tokens - before[1])
        self.steps_without_masks = 0 if rows else self.steps_without_masks + 1
        return finished
