"""Random draws for the rows of a batch: each request samples from its own seed's generator (so
its answer does not depend on the batch), and one request's failed draw fails that request alone."""

from __future__ import annotations

import numpy as np
import torch


def shared_generator(device, seed: int | None) -> torch.Generator:
    """The one generator of the requests that name no seed: of the decoder's ``seed``, else of
    torch's default seed, so that an unseeded run draws as the last one did."""
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    return generator


def row_generator(seed: int | None, device) -> torch.Generator | None:
    """A request's own generator, of its ``seed``; None without one: it draws from the shared one."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class RowDraws:
    def __init__(self, device, seed: int | None = None):
        self.device = device
        self.generator = shared_generator(device, seed)  # for requests that name no seed
        self.errors: dict = {}  # request id -> why its row failed in this step; it leaves at the step's end

    def tokens(self, probs: torch.Tensor, selected: np.ndarray, generators: list, request_ids: list) -> np.ndarray:
        """One token per selected entry from ``probs`` ``[n, vocab]`` (n = len(selected)), each with
        its row's generator; unselected entries get 0. Entries are rows, or ``n // rows`` per row
        (a row's masks), in row order.

        A row whose draw fails is recorded in ``errors`` and draws 0: it finishes, failed, at the
        end of this step, and the other rows' draws go on. Probabilities are checked first because
        a GPU's multinomial does not raise on NaN, it aborts the whole process's device context.
        """
        out = np.zeros(len(selected), np.int64)
        per_row = len(selected) // len(request_ids)
        valid = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).cpu().numpy()
        for i in np.flatnonzero(selected):
            row = i // per_row
            try:
                if not valid[i]:
                    raise ValueError("its sampling probabilities are not finite")
                out[i] = int(torch.multinomial(probs[i], 1, generator=generators[row] or self.generator)[0])
            except Exception as exc:  # noqa: BLE001 - one request's numbers must not end the others'
                self.errors.setdefault(request_ids[row], f"{type(exc).__name__}: {exc}")
        return out

    def uniforms(self, selected: np.ndarray, counts: np.ndarray, width: int, generators: list) -> torch.Tensor:
        """``[rows, width]`` uniforms on the device (ones where not drawn); a selected row draws
        ``counts[row]`` of them from its generator."""
        out = torch.ones(len(selected), width, device=self.device)
        for i in np.flatnonzero(selected):
            n = int(counts[i])
            out[i, :n] = torch.rand(n, generator=generators[i] or self.generator, device=self.device)
        return out
