"""The load generator's client: one streamed chat completion measured from the client's side
(time to first token, latency, the server's tokens per forward from ``usage``), a level of
closed-loop workers, and a level's summary. Shared by ``marslm loadtest`` and its vLLM variant.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass


@dataclass
class Sample:
    ok: bool
    latency: float
    ttft: float | None
    text: str
    completion_tokens: int = 0
    forwards: int = 0
    accepted: float = 0.0  # tokens_per_forward * forwards: decoded tokens, stop token included
    error: str = ""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


async def one_request(
    client,
    url: str,
    headers: dict,
    model: str,
    messages: list,
    max_tokens: int,
    timeout: float,
    fields: dict | None = None,
) -> Sample:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        # Greedy unless a contender says otherwise: OpenAI's default is 1.0, and vLLM applies it.
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(fields or {}),
    }
    started = time.perf_counter()
    ttft, parts, usage = None, [], None
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return Sample(False, time.perf_counter() - started, None, "", error=f"{response.status_code} {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return Sample(False, time.perf_counter() - started, ttft, "", error=chunk["error"]["message"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        parts.append(content)
    except Exception as exc:  # a timeout or a dropped connection is a failed sample, not a crash
        return Sample(False, time.perf_counter() - started, ttft, "", error=f"{type(exc).__name__}: {exc}")
    usage = usage or {}
    forwards = usage.get("forwards", 0)
    return Sample(
        True,
        time.perf_counter() - started,
        ttft,
        "".join(parts),
        usage.get("completion_tokens", 0),
        forwards,
        usage.get("tokens_per_forward", 0.0) * forwards,
    )


async def run_level(
    client, url, headers, model, examples, concurrency, max_tokens, timeout, fields: dict | None = None
) -> tuple[list, float]:
    """Send every example once with ``concurrency`` closed-loop workers; samples in example order.
    ``fields``: extra request fields (tau, mode, ...) for every request."""
    samples: list[Sample | None] = [None] * len(examples)
    next_index = iter(range(len(examples)))

    async def worker():
        for i in next_index:  # a shared iterator: each index is taken by exactly one worker
            samples[i] = await one_request(
                client, url, headers, model, examples[i].messages, max_tokens, timeout, fields
            )

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(examples)))))
    return samples, time.perf_counter() - started


def summarise(samples: list[Sample], wall: float, correct: list[bool]) -> dict:
    ok = [s for s in samples if s.ok]
    latencies = [s.latency for s in ok]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    forwards = sum(s.forwards for s in ok)

    def pct(values):
        return {f"p{q}": round_or_none(percentile(values, q)) for q in (50, 90, 99)}

    return {
        "ok": len(ok),
        "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if not s.ok), None),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "tokens_per_s": tokens_per_s(samples, wall),
        "completion_tokens": sum(s.completion_tokens for s in ok),
        "tokens_per_forward": round(sum(s.accepted for s in ok) / forwards, 4) if forwards else None,
        "latency_s": pct(latencies) | {"mean": round_or_none(sum(latencies) / len(latencies)) if latencies else None},
        "ttft_s": pct(ttfts),
        "accuracy": round(sum(correct) / len(correct), 4) if correct else None,
    }


def tokens_per_s(samples: list[Sample], wall: float) -> float | None:
    """Completion tokens of the successful samples per second of ``wall``."""
    return round(sum(s.completion_tokens for s in samples if s.ok) / wall, 2) if wall else None


def round_or_none(value, digits: int = 4):
    return None if value is None else round(value, digits)
