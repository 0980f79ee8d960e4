"""Random draws for the rows of a batch, keyed by position.

A row draws the token at position P from probabilities p by an exponential race: argmax p / E,
with E one Exp(1) variate per token, which picks token i with probability p_i. E comes from the
row's seed and P alone, so a row's sample does not depend on the batch, on which steps read masks,
or on what was drafted. Lossless mode draws its draft for P from the masks' distribution q with
the same E that the target's token at P is drawn with, and keeps the draft where the two races
agree: the output is the target's race winner whatever the draft (drafter-invariant speculative
sampling, Daliri et al. 2024, arXiv 2408.07978), exactly distributed as sampling the AR model
alone, with the text of plain sampling at the same seed.

A request names its seed, or takes the decoder's (torch's default seed without one) plus the
number of seedless rows that joined before it: an unseeded run repeats itself, and its rows differ.
One request's failed draw fails that request alone.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = 2**64 - 1
SEEDS = 2**63  # a seed is an integer in 0..2^63-1 (params.check_seed)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a row's draw at ``position``: seeds and positions mixed, so that
    neighbouring seeds or positions give unrelated noise."""
    return _splitmix64(_splitmix64(seed) ^ position)


class RowDraws:
    def __init__(self, device, seed: int | None = None):
        self.seed = torch.Generator().initial_seed() if seed is None else seed
        self.unseeded = 0  # seedless rows so far: the next one samples with seed + this
        self.generator = torch.Generator(device=device)
        self.errors: dict = {}  # request id -> why its row failed in this step; it leaves at the step's end

    def row_seeds(self, seeds: list[int | None]) -> np.ndarray:
        """The seeds joining rows sample with: their own, else the decoder's plus a count."""
        out = []
        for seed in seeds:
            if seed is None:
                seed, self.unseeded = (self.seed + self.unseeded) % SEEDS, self.unseeded + 1
            out.append(seed)
        return np.array(out, np.int64)

    def race(self, probs: torch.Tensor, seed: int, positions) -> torch.Tensor:
        """The race winners of ``probs`` ``[n, vocab]``, row j drawn at ``positions[j]``."""
        noise = torch.empty_like(probs, dtype=torch.float32)
        for j, position in enumerate(positions):
            self.generator.manual_seed(position_seed(int(seed), int(position)))
            noise[j].exponential_(generator=self.generator)
        # a token of probability 0 must lose even to noise that rounded to 0
        return (probs.float() / noise.clamp_min(1e-30)).argmax(dim=-1)

    def tokens(self, probs: torch.Tensor, selected: np.ndarray, seeds, positions, request_ids: list) -> np.ndarray:
        """One token per selected entry of ``probs`` ``[n, vocab]`` (n = len(selected)), raced at
        ``positions[i]`` with its row's seed; unselected entries get 0. Entries are rows, or
        ``n // rows`` per row (a row's candidates), in row order.

        A row whose draw fails is recorded in ``errors`` and draws 0: it finishes, failed, at the
        end of this step, and the other rows' draws go on. Probabilities are checked first because
        a GPU's kernels do not raise on NaN.
        """
        out = np.zeros(len(selected), np.int64)
        per_row = len(selected) // len(request_ids)
        valid = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).cpu().numpy()
        for row in np.unique(np.flatnonzero(selected) // per_row):
            entries = np.flatnonzero(selected[row * per_row : (row + 1) * per_row]) + row * per_row
            try:
                if not valid[entries].all():
                    raise ValueError("its sampling probabilities are not finite")
                won = self.race(probs[torch.from_numpy(entries).to(probs.device)], seeds[row], positions[entries])
                out[entries] = won.cpu().numpy()
            except Exception as exc:  # noqa: BLE001 - one request's numbers must not end the others'
                self.errors.setdefault(request_ids[row], f"{type(exc).__name__}: {exc}")
        return out
