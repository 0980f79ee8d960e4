"""``marslm loadtest --engine vllm --checkpoint DIR``: MARS inside vLLM against vLLM's own decoding, under load.

Three vLLM servers start on the checkpoint, each in vLLM's environment: plain (no speculative
decoding), ngram (vLLM's prompt-lookup drafter, B draft tokens) and MARS (the plugin). Four
contenders share them:

    vLLM plain AR         the plain server
    vLLM ngram            the ngram server
    vLLM MARS lossless    the MARS server, requests with mode "lossless" (output = plain greedy)
    vLLM MARS tau T       the MARS server, requests with tau T

For each repeat, each concurrency level and each contender in turn (interleaved, so a slow
spell of a shared machine hits every contender alike), the toy test prompts go out as streaming
chat completions from closed-loop workers (``load_client.run_level``). Reported per contender and
level: completion tokens per second (median over repeats, and the range), tokens per forward
(from ``usage``; 1 for plain decoding), accuracy on the toy suite and the speed-up over plain
at the same level.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..vllm.launch import serve_command

if TYPE_CHECKING:
    from .loadtest import LoadtestConfig


@dataclass(frozen=True)
class Contender:
    name: str
    server: str  # "none" | "ngram" | "mars": the server's --speculative
    fields: dict | None  # request fields


def contenders(taus=(0.95,)) -> list[Contender]:
    return [
        Contender("vLLM plain AR", "none", None),
        Contender("vLLM ngram", "ngram", None),
        Contender("vLLM MARS lossless", "mars", {"mode": "lossless"}),
        *[Contender(f"vLLM MARS tau {tau:g}", "mars", {"tau": tau}) for tau in taus],
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, model: str, speculative: str, vllm_args: list[str], log_dir: Path, mask_batch_limit=None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-{speculative}.log"
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                serve_command(
                    model,
                    port=self.port,
                    speculative=speculative,
                    log_level="warning",
                    mask_batch_limit=mask_batch_limit if speculative == "mars" else None,
                    vllm_args=vllm_args,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait(self, deadline: float) -> None:
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise UserError(f"the vLLM server exited; its log ends:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"the vLLM server did not start in time; its log ends:\n{self._log_tail()}")
            time.sleep(1)

    def _log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run_vllm_bench(config: LoadtestConfig, *, start_timeout: float = 600.0, log=print) -> dict:
    """Start the servers on ``config.checkpoint``, measure every contender, stop the servers."""
    field = contenders(config.taus)
    servers: dict[str, _Server] = {}
    with tempfile.TemporaryDirectory(prefix="marslm-vllm-bench-") as log_dir:
        try:
            for kind in dict.fromkeys(c.server for c in field):
                servers[kind] = _Server(
                    config.checkpoint, kind, list(config.vllm_args), Path(log_dir), config.mask_batch_limit
                )
            deadline = time.monotonic() + start_timeout
            for server in servers.values():
                server.wait(deadline)
            log(f"vllm bench: {len(servers)} servers up")
            runs = asyncio.run(_measure(servers, field, config, log))
        finally:
            for server in servers.values():
                server.stop()
    return {
        "model": config.checkpoint,
        "engine": "vllm",
        "requests": config.requests,
        "max_tokens": config.max_tokens,
        "repeats": config.repeats,
        "mask_batch_limit": config.mask_batch_limit,
        "concurrency": list(config.concurrency),
        "data": "toy test split",
        "runs": runs,
        "results": summarise(runs, field, config.concurrency),
    }


async def _measure(servers, field, config: LoadtestConfig, log, settle: float = 3.0) -> list[dict]:
    from ..data import toy
    from .load_client import one_request, run_level, summarise
    from .loadtest import http_client

    examples = toy.make_split("test", config.requests, seed=config.seed)
    runs = []
    async with http_client(config) as client:
        models = {}
        for kind, server in servers.items():
            models[kind] = (await client.get(server.url + "/v1/models")).json()["data"][0]["id"]
            await one_request(client, server.url, {}, models[kind], examples[0].messages, 8, config.timeout)  # warm-up
        for repeat in range(config.repeats):
            for concurrency in config.concurrency:
                for contender in field:
                    server = servers[contender.server]
                    # A vLLM worker keeps polling for a moment after its last request; on a machine
                    # with few cores it would take them from the next contender's server.
                    await asyncio.sleep(settle)
                    samples, wall = await run_level(
                        client,
                        server.url,
                        {},
                        models[contender.server],
                        examples,
                        concurrency,
                        config.max_tokens,
                        config.timeout,
                        contender.fields,
                    )
                    correct = await asyncio.to_thread(
                        toy.score_many, examples, [s.text if s.ok else None for s in samples]
                    )
                    entry = {
                        "contender": contender.name,
                        "concurrency": concurrency,
                        "repeat": repeat,
                        **summarise(samples, wall, correct),
                    }
                    if contender.server == "none":
                        entry["tokens_per_forward"] = 1.0  # no drafts: one token per forward by construction
                    runs.append(entry)
                    log(
                        f"vllm bench: {contender.name:>20} x{concurrency:<3} #{repeat}: {entry['tokens_per_s']} "
                        f"tok/s, {entry['tokens_per_forward']} tok/fwd, accuracy {entry['accuracy']}, "
                        f"errors {entry['errors']}"
                    )
    return runs


def summarise(runs: list[dict], field, concurrencies) -> list[dict]:
    rows = []
    for concurrency in concurrencies:
        plain = [r["tokens_per_s"] for r in runs if r["concurrency"] == concurrency and r["contender"] == field[0].name]
        for contender in field:
            mine = [r for r in runs if r["concurrency"] == concurrency and r["contender"] == contender.name]
            if not mine:
                continue
            speed = [r["tokens_per_s"] or 0.0 for r in mine]
            rows.append(
                {
                    "contender": contender.name,
                    "concurrency": concurrency,
                    "tokens_per_s": round(statistics.median(speed), 1),
                    "tokens_per_s_min": min(speed),
                    "tokens_per_s_max": max(speed),
                    "speedup": round(statistics.median(speed) / statistics.median(plain), 3)
                    if plain and statistics.median(plain)
                    else None,
                    "tokens_per_forward": mine[-1]["tokens_per_forward"],
                    "accuracy": mine[-1]["accuracy"],
                    "errors": sum(r["errors"] for r in mine),
                }
            )
    return rows


def format_table(report: dict) -> str:
    lines = [
        "| contender | concurrency | tok/s (median; min-max) | x plain | tok/fwd | accuracy | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['contender']} | {r['concurrency']} | {r['tokens_per_s']} ({r['tokens_per_s_min']}-"
            f"{r['tokens_per_s_max']}) | {r['speedup']} | {r['tokens_per_forward']} | {r['accuracy']} "
            f"| {r['errors']} |"
        )
    return "\n".join(lines)


def loadtest(config: LoadtestConfig, log=print) -> tuple[dict, object]:
    """vLLM's side of ``marslm loadtest``: its servers started on ``--checkpoint``, side by side."""
    from ..modeling import check_model_source
    from ..vllm.launch import vllm_python

    check_model_source(config.checkpoint)
    vllm_python()
    return run_vllm_bench(config, log=log), format_table
