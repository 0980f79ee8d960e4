"""The server's default tau, fixed or adaptive with load; an admin may move it live."""

from __future__ import annotations

import math
import threading

from ..decode import check_tau
from ..errors import UserError
from .config import POLICIES


class TauController:
    """The default tau: fixed, or adaptive between ``floor`` and ``ceiling``.

    Adaptive, every engine turn:

        pressure = max(queue_depth / max_batch, step_latency / slo - 1), clipped to [0, 1]
        target   = ceiling - pressure * (ceiling - floor)

    tau drops to the target at once (requests are waiting now, and waiting makes the queue
    longer) but climbs back at most ``recover_per_s`` per second, so a queue that empties for a
    step does not make tau flap. A lower tau accepts more tokens per forward: requests finish in
    fewer steps and free their rows sooner, which is what drains the queue. Between the bounds
    values are rounded to 0.01 so running rows are touched only when the default really changes;
    the bounds themselves are exactly what was set.
    """

    def __init__(
        self, tau: float, policy: str, floor: float, slo_ms: float | None, max_batch: int, recover_per_s: float = 0.1
    ):
        self._lock = threading.Lock()
        self.max_batch = max_batch
        self.recover_per_s = recover_per_s
        self.changes = {"down": 0, "up": 0}
        self._latency_ema: float | None = None
        self._last: float | None = None
        self.configure(policy=policy, tau=tau, floor=floor, slo_ms=slo_ms)

    def configure(
        self,
        *,
        policy: str | None = None,
        tau: float | None = None,
        floor: float | None = None,
        slo_ms: float | None | str = "keep",
    ) -> None:
        """Change the policy and its bounds (admin); ``tau`` is the ceiling, and the default now."""
        with self._lock:
            policy = policy if policy is not None else self.policy
            ceiling = tau if tau is not None else self.ceiling
            # A new default below the current floor (and no new floor) takes the floor down with it:
            # under the fixed policy the floor is unused, and an admin's explicit tau should win.
            floor = floor if floor is not None else min(self.floor, ceiling)
            slo_ms = self.slo_ms if slo_ms == "keep" else slo_ms
            if policy not in POLICIES:
                raise UserError(f"tau policy must be one of {', '.join(POLICIES)}, got {policy!r}")
            check_tau(ceiling, "prob")
            check_tau(floor, "prob")
            if floor > ceiling:
                raise UserError(f"tau floor {floor} is above the default tau {ceiling}")
            if slo_ms is not None and not (math.isfinite(slo_ms) and slo_ms > 0):
                raise UserError(f"slo_ms must be a finite number > 0 (or null: off), got {slo_ms}")
            self.policy, self.ceiling, self.floor, self.slo_ms = policy, float(ceiling), float(floor), slo_ms
            self._level = self.ceiling
            self._set(self.ceiling)

    def _set(self, level: float) -> None:
        tau = self.ceiling if level >= self.ceiling else self.floor if level <= self.floor else round(level, 2)
        tau = min(max(tau, self.floor), self.ceiling)
        current = getattr(self, "tau", None)
        if current is not None and tau != current:
            self.changes["down" if tau < current else "up"] += 1
        self.tau = tau

    def observe(self, now: float, queue_depth: int, step_ms: float | None) -> float:
        """Feed one engine turn (``step_ms`` None: the batch was idle); returns the default tau."""
        with self._lock:
            dt = 0.0 if self._last is None else now - self._last
            self._last = now
            if step_ms is None:
                self._latency_ema = None  # no batch, no latency pressure
            else:
                self._latency_ema = step_ms if self._latency_ema is None else 0.7 * self._latency_ema + 0.3 * step_ms
            if self.policy == "fixed":
                return self.tau
            pressure = queue_depth / self.max_batch
            if self.slo_ms and self._latency_ema is not None:
                pressure = max(pressure, self._latency_ema / self.slo_ms - 1)
            pressure = min(max(pressure, 0.0), 1.0)
            target = self.ceiling - pressure * (self.ceiling - self.floor)
            # _level is the unrounded tau: many short turns add up to a visible climb
            if target < self._level:
                self._level = target
            else:
                self._level = min(target, self._level + self.recover_per_s * dt)
            self._set(self._level)
            return self.tau

    def state(self) -> dict:
        with self._lock:
            return {
                "policy": self.policy,
                "tau": self.tau,
                "ceiling": self.ceiling,
                "floor": self.floor,
                "slo_ms": self.slo_ms,
                "changes": dict(self.changes),
            }
