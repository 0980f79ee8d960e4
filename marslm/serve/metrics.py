"""What the engine counts, and the Prometheus text format /metrics answers with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .requests import Result

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative; rendering accumulates
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        other = Histogram(self.buckets)
        other.counts, other.sum, other.count = list(self.counts), self.sum, self.count
        return other


@dataclass
class EngineMetrics:
    requests: dict = field(default_factory=lambda: {"finished": 0, "cancelled": 0, "error": 0, "rejected": 0})
    prompt_tokens: int = 0
    generation_tokens: int = 0  # tokens sent to clients (stop tokens excluded)
    accepted_tokens: int = 0  # tokens accepted by forwards (stop tokens included)
    forwards: int = 0  # model calls (one per step, whatever the batch)
    row_forwards: int = 0  # sum over requests of the forwards each took part in
    histograms: dict = field(
        default_factory=lambda: {
            name: Histogram()
            for name in (
                "request_latency_seconds",
                "time_to_first_token_seconds",
                "queue_wait_seconds",
                "step_latency_seconds",
            )
        }
    )

    def count_finished(self, result: Result, latency: float, first_token: float) -> None:
        """A request that ran to its end; ``latency`` and ``first_token``: seconds from its arrival."""
        self.requests["finished"] += 1
        self.generation_tokens += result.completion_tokens
        self.accepted_tokens += sum(result.accepted_per_step)
        self.row_forwards += result.forwards
        self.histograms["request_latency_seconds"].observe(latency)
        self.histograms["time_to_first_token_seconds"].observe(first_token)

    def retry_after(self, waiting: int, max_batch: int) -> int:
        """Seconds until a queue of ``waiting`` has likely moved on: its waves times the mean request time."""
        latency = self.histograms["request_latency_seconds"]
        mean = latency.sum / latency.count if latency.count else 1.0
        return max(1, min(60, math.ceil(waiting / max_batch * mean)))

    def snapshot(self) -> dict:
        """A copy of the counters and histograms (taken under the engine's lock)."""
        return {
            "requests": dict(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forwards": self.forwards,
            "row_forwards": self.row_forwards,
            "tokens_per_forward": self.accepted_tokens / self.row_forwards if self.row_forwards else 0.0,
            "histograms": {name: h.copy() for name, h in self.histograms.items()},
        }


def render_metrics(snap: dict, model_name: str) -> str:
    lines: list[str] = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP marslm_{name} {help_text}")
        lines.append(f"# TYPE marslm_{name} {kind}")
        for labels, value in samples:
            label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            lines.append(f"marslm_{name}{label_text} {_num(value)}")

    tau = snap["tau"]
    metric(
        "requests_total",
        "counter",
        "Requests by outcome (rejected: queue full).",
        [({"status": k}, v) for k, v in snap["requests"].items()],
    )
    metric("prompt_tokens_total", "counter", "Prompt tokens admitted.", [({}, snap["prompt_tokens"])])
    metric(
        "generation_tokens_total",
        "counter",
        "Tokens generated (stop tokens excluded).",
        [({}, snap["generation_tokens"])],
    )
    metric(
        "forwards_total",
        "counter",
        "Model forwards (one per engine step, for the whole batch).",
        [({}, snap["forwards"])],
    )
    metric("row_forwards_total", "counter", "Forwards summed over finished requests.", [({}, snap["row_forwards"])])
    metric(
        "tokens_per_forward",
        "gauge",
        "Tokens accepted per forward, over finished requests.",
        [({}, snap["tokens_per_forward"])],
    )
    metric("queue_depth", "gauge", "Requests waiting for a batch row.", [({}, snap["queue_depth"])])
    metric("active_batch", "gauge", "Requests in the running batch.", [({}, snap["active_batch"])])
    metric("max_batch", "gauge", "Rows the batch may hold.", [({}, snap["max_batch"])])
    metric("default_tau", "gauge", "Default tau, for requests that name none.", [({}, tau["tau"])])
    metric("tau_ceiling", "gauge", "Default tau at low load (adaptive) or always (fixed).", [({}, tau["ceiling"])])
    metric("tau_floor", "gauge", "Lowest default tau the adaptive policy may set.", [({}, tau["floor"])])
    metric(
        "tau_policy",
        "gauge",
        "Active default-tau policy (1 = active).",
        [({"policy": p}, int(p == tau["policy"])) for p in ("fixed", "adaptive")],
    )
    metric(
        "tau_changes_total",
        "counter",
        "Changes of the default tau, by direction.",
        [({"direction": d}, n) for d, n in tau["changes"].items()],
    )
    _info_metrics(metric, snap, model_name)
    for name, hist in snap["histograms"].items():
        _histogram(lines, name, hist)
    return "\n".join(lines) + "\n"


def _info_metrics(metric, snap: dict, model_name: str) -> None:
    """What is served: the model, and the separate draft model if there is one."""
    metric("model_info", "gauge", "The served model.", [({"model": model_name}, 1)])
    if snap.get("drafter"):
        labels = {k: v for k, v in snap["drafter"].items() if v is not None}
        metric("drafter_info", "gauge", "The separate draft model (--draft-model).", [(labels, 1)])


_HISTOGRAM_HELP = {
    "request_latency_seconds": "Arrival to last token, per finished request.",
    "time_to_first_token_seconds": "Arrival to first token, per finished request.",
    "queue_wait_seconds": "Arrival to admission into the batch.",
    "step_latency_seconds": "Wall time of one engine step (one forward).",
}


def _histogram(lines: list[str], name: str, hist: Histogram) -> None:
    lines.append(f"# HELP marslm_{name} {_HISTOGRAM_HELP.get(name, name)}")
    lines.append(f"# TYPE marslm_{name} histogram")
    cumulative = 0
    for bound, count in zip(hist.buckets, hist.counts):
        cumulative += count
        lines.append(f'marslm_{name}_bucket{{le="{bound}"}} {cumulative}')
    lines.append(f'marslm_{name}_bucket{{le="+Inf"}} {hist.count}')
    lines.append(f"marslm_{name}_sum {_num(hist.sum)}")
    lines.append(f"marslm_{name}_count {hist.count}")


def _num(value) -> str:
    return str(value) if isinstance(value, int) else repr(round(float(value), 6))
