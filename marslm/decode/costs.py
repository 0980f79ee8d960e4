"""Whether a step with masks pays on this machine: the cost table, and the limit that reads it.

A cost table is a masked step's cost per batch size as a ratio to a one-token step, taken from a
cost curve (cost_curve.py). ``marslm bench --cost-curve --save`` keeps one beside the checkpoint;
otherwise the first call that needs one measures it, for the batch sizes it pads to, and keeps it
in marslm's cache for that checkpoint, machine and setting (:func:`mask_limit`).
``MaskBatchLimit`` turns a table into ``mask_batch_limit="auto"``: masks are read at a batch size
while the tokens per row a masked step has been buying exceed what such a step costs there.

Decoding never times anything: a table is measured before decoding starts, then only read, so the
same model, inputs and settings give the same text on a machine, in any process, after any
earlier call.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch

from ..errors import UserError
from ..files import cache_root, write_json_atomically

log = logging.getLogger("marslm.costs")

COST_TABLE = "marslm-costs.json"  # beside the checkpoint's marslm.json


def table_from_curve(report: dict, block_size: int) -> dict:
    """The cost table of a :func:`cost_curve` report: per batch size, the cost of a masked step (a
    row feeds its last accepted tokens, about two, and ``block_size`` masks) as a ratio to a
    one-token step, the highest over the report's contexts (a compiled curve's: the width such a
    step is padded to)."""
    width = min((w for w in report["widths"] if w >= block_size + 2), default=block_size + 2)
    costs: dict[int, float] = {}
    for row in report["rows"]:
        if row["width"] == width:
            costs[row["batch_size"]] = max(costs.get(row["batch_size"], 0.0), row["ratio"])
    if not costs:
        raise UserError(f"the cost curve has no width {width} (block size {block_size} + 2) to make a table of")
    return {
        "block_size": block_size,
        "costs": {str(b): round(c, 4) for b, c in sorted(costs.items())},
        "measured_on": {key: report.get(key) for key in ("device", "threads", "repeats", "compiled")},
    }


def save_cost_table(directory: str | Path, table: dict) -> Path:
    path = Path(directory) / COST_TABLE
    path.write_text(json.dumps(table, indent=2) + "\n")
    return path


def saved_mask_limit(model, block_size: int) -> MaskBatchLimit | None:
    """A fresh :class:`MaskBatchLimit` over the cost table saved beside ``model`` for
    ``block_size`` (:func:`read_cost_table`), or None where there is none."""
    table = read_cost_table(model, block_size)
    if table is None:
        return None
    costs, path = table
    return MaskBatchLimit(costs, most=2 * block_size + 1, source=path)


def mask_limit(model, block_size: int, *, rows: int, compiled: bool, capacity: int | None = None, reserve: int = 0):
    """``mask_batch_limit="auto"``'s :class:`MaskBatchLimit` for a decoder of up to ``rows`` rows:
    over the table saved beside the checkpoint (``bench --cost-curve --save``), else over the one
    kept in marslm's cache for this checkpoint, machine and setting (:func:`kept_table_key`),
    measured there on first need (seconds: :func:`measure_table`). None where neither can be had:
    a model with no checkpoint folder to key a table by, or ``MARSLM_COSTS=off``.

    Measuring is a phase before decoding, never inside it: once kept, a table is read, so the same
    inputs and settings decode to the same text on every later run on that machine."""
    saved = saved_mask_limit(model, block_size)
    if saved is not None:
        return saved
    key = kept_table_key(model, block_size, compiled)
    if key is None:
        return None
    path = cache_root() / "costs" / f"{key['digest']}.json"
    kept = _read_kept(path, key) or {"costs": {}}
    missing = [b for b in _batch_sizes(rows) if str(b) not in kept["costs"]]
    if missing:
        if os.environ.get(COSTS_ENV, "auto").strip().lower() in ("off", "0", "no", "false"):
            return None if not kept["costs"] else _limit(kept, block_size, path)
        shape = dict(capacity=capacity, reserve=reserve)
        measured = measure_table(model, block_size, batch_sizes=missing, compiled=compiled, **shape)
        kept = {**measured, "costs": {**kept["costs"], **measured["costs"]}, "key": key}
        write_json_atomically(path, kept)
    return _limit(kept, block_size, path)


def _limit(table: dict, block_size: int, path: Path) -> MaskBatchLimit:
    costs = {int(b): float(c) for b, c in table["costs"].items()}
    return MaskBatchLimit(costs, most=2 * block_size + 1, source=str(path))


def _batch_sizes(rows: int) -> list[int]:
    """The batch sizes a decoder of up to ``rows`` rows pads its batches to: 1, 2, 4 ..."""
    return [1 << i for i in range(max(rows - 1, 0).bit_length() + 1)]


COSTS_ENV = "MARSLM_COSTS"  # off: auto reads a saved table only, and measures none


def kept_table_key(model, block_size: int, compiled: bool) -> dict | None:
    """What a kept cost table is for: the checkpoint (its folder and its files' names, sizes and
    modification times: a retrained checkpoint is another one), torch's version, the device, the
    dtype, the thread count, the block size and whether the step is compiled; with its digest.
    None for a model that names no checkpoint folder."""
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    if not folder.is_dir():
        return None
    files = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.iterdir()
        if p.is_file() and p.suffix in (".json", ".safetensors", ".bin") and p.name != COST_TABLE
    )
    param = next(model.parameters())
    key = {
        "checkpoint": str(folder.resolve()),
        "files": [list(f) for f in files],
        "torch": torch.__version__,
        "device": str(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "block_size": block_size,
        "compiled": compiled,
    }
    key["digest"] = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return key


def _read_kept(path: Path, key: dict) -> dict | None:
    """The table kept at ``path`` if it is whole and made for ``key``; a damaged one is dropped
    with one warning (it is measured again)."""
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
        costs = {int(b): float(c) for b, c in table["costs"].items()}
        if table["key"] != key or not costs or any(b < 1 or not (math.isfinite(c) and c > 0) for b, c in costs.items()):
            raise ValueError("not this checkpoint's table")
        return table
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("the kept cost table %s is unreadable (%s); measuring it again", path, exc.__class__.__name__)
        return None


def measure_table(
    model, block_size: int, *, batch_sizes, compiled: bool, capacity: int | None = None, reserve: int = 0
) -> dict:
    """A cost table measured now: a masked step's cost against a one-token step at ``batch_sizes``,
    through the step decoding runs (compiled over a static cache of ``capacity`` slots whose
    buffers hold ``reserve`` rows, as the decoder's do, or eager),
    over a context short enough that both steps attend over the smallest window: the graphs a
    compiled decoder meets first, so that measuring compiles nothing decoding would not."""
    from .forward import bucket
    from .kv import MIN_WINDOW

    masked = bucket(block_size + 2) if compiled else None
    compiled = compiled and masked is not None
    width = masked or block_size + 2
    log.info(
        "measuring the cost table for batch sizes %s (%s step; once per checkpoint and machine)",
        ", ".join(map(str, batch_sizes)),
        "compiled" if compiled else "eager",
    )
    from .cost_curve import cost_curve

    report = cost_curve(
        model,
        widths=(1, width),
        contexts=(max(TABLE_CONTEXT, MIN_WINDOW - width),),
        batch_sizes=tuple(batch_sizes),
        repeats=TABLE_REPEATS,
        compile=compiled,
        capacity=capacity,
        reserve=reserve,
    )
    return table_from_curve(report, block_size)


TABLE_CONTEXT = 16  # the fewest cached tokens a kept table's steps attend over
TABLE_REPEATS = 5


def read_cost_table(model, block_size: int) -> tuple[dict[int, float], str] | None:
    """``(costs per batch size, the file)`` saved beside ``model``'s checkpoint for ``block_size``,
    or None where there is none (a hub id, no ``--save`` yet, another block size)."""
    path = Path(str(getattr(model, "name_or_path", "") or "")) / COST_TABLE
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
        costs = {int(b): float(c) for b, c in table["costs"].items()}
        saved_for = table["block_size"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(
            f"{path}: not a cost table ({exc.__class__.__name__}); remake it with marslm bench --cost-curve --save"
        ) from None
    if not costs or any(b < 1 or not math.isfinite(c) or c <= 0 for b, c in costs.items()):
        raise UserError(f"{path}: a cost table needs batch sizes >= 1 and finite costs > 0")
    if saved_for != block_size:
        return None
    return costs, str(path)


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

    def __init__(
        self,
        step_cost: dict[int, float],
        prior: float = 1.5,
        weight: float = 0.05,
        most: float = math.inf,
        source: str | None = None,
    ):
        self.step_cost = dict(sorted(step_cost.items()))
        self.source = source  # the cost table's file, named in the output's stats
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
