"""``marslm loadtest``: throughput, latency percentiles and accuracy of a running server, per tau policy.

For each policy and each concurrency level, ``requests`` prompts from the toy test split are sent
as streaming chat completions by ``concurrency`` closed-loop workers (each sends its next request
when the previous one ends), and measured client-side: time to first token, request latency,
completion tokens per second over the run's wall time, and the server's ``tokens_per_forward``
(from ``usage``). The answers are scored with ``toy.score_many`` after the timed window, so
"accuracy within 2 points of tau = 1" can be checked at the load where it matters.

How a policy is applied: through the server's admin API, not per request. ``POST /admin/policy``
sets ``fixed`` at tau 1.0 / 0.95, or ``adaptive`` between ``--adaptive-tau`` (the ceiling) and
``--tau-floor``; the requests name no tau, so they follow the server's default exactly as
production traffic would. The server's own policy is read first and restored at the end.
Use ``--api-key`` if the server has one.

Runs are interleaved: each of ``repeats`` rounds runs every level and, side by side, every
policy once, so a slow spell of a shared machine slows every policy alike; a cell reports its
rounds pooled (tokens over summed wall time) and each round's tokens per second.

Everything is bounded: ``requests`` per run, ``--timeout`` per request, and a wall-clock
``--deadline`` after which the remaining runs are skipped.

The settings of a run, also those of ``--engine vllm`` (``vllm_loadtest.py``), are a
:class:`LoadtestConfig`, checked when it is made; the CLI builds it from its options.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..decode.params import check_mask_batch_limit, check_tau
from ..errors import UserError
from ..files import output_file
from ..serve.config import no_extra_args
from ..serve.engines import NAMES, engine
from ..settings import check_count, flag_of, floats, ints, setting
from .load_client import one_request, run_level, summarise, tokens_per_s

POLICIES = ("fixed-1.0", "fixed-0.95", "adaptive")


def policy_settings(name: str, adaptive_tau: float = 0.95, tau_floor: float = 0.9) -> dict:
    """The ``POST /admin/policy`` body for a policy name: ``fixed-<tau>`` or ``adaptive``; every tau
    is checked as the server will, so a bad one is refused before any load is sent."""
    for flag, tau in (("--adaptive-tau", adaptive_tau), ("--tau-floor", tau_floor)):
        try:
            check_tau(tau, "prob")
        except UserError as exc:
            raise UserError(f"{flag}: {exc}") from None
    if name == "adaptive":
        return {"policy": "adaptive", "tau": adaptive_tau, "tau_floor": min(tau_floor, adaptive_tau)}
    if name.startswith("fixed-"):
        try:
            tau = float(name[len("fixed-") :])
            check_tau(tau, "prob")
        except (ValueError, UserError) as exc:
            raise UserError(f"bad policy {name!r} ({exc}); use fixed-<tau> or adaptive") from None
        return {"policy": "fixed", "tau": tau, "tau_floor": min(tau_floor, tau)}
    raise UserError(f"bad policy {name!r}; use fixed-<tau> or adaptive")


def check_url(url: str) -> None:
    """An http(s) URL httpx can send to, or one line naming ``--url``."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise UserError(f"--url {url!r} is not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UserError(f"--url must be an http:// or https:// URL with a host, got {url!r}")


def answer_summary(response) -> str:
    """A server's refusal in one line: its status, and the message of a JSON error body (an HTML
    page or a traceback stays out of the user's terminal)."""
    summary = f"{response.status_code} {response.reason_phrase}".strip()
    try:
        body = response.json()
    except ValueError:
        return summary
    error = body.get("error", body.get("detail")) if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    if isinstance(message, str) and message.strip():
        summary += ": " + " ".join(message.split())[:200]
    return summary


@dataclass
class LoadtestConfig:
    """One ``marslm loadtest`` run; its options are these fields (settings.py), checked when it is made.

    Two engines share them: a running marslm server (the default: ``url`` and the policies) and
    vLLM servers started on ``checkpoint`` (``taus`` and ``vllm_args``); each checks the fields it
    reads.
    """

    url: str = setting("http://127.0.0.1:8000", "server base URL")
    concurrency: list = setting([1, 8, 32], "comma-separated levels", parse=ints)
    requests: int = setting(64, "requests per policy and level")
    policies: list = setting(
        list(POLICIES),
        "comma-separated: fixed-<tau> or adaptive",
        parse=lambda text: [p for p in text.split(",") if p],
    )
    adaptive_tau: float = setting(0.95, "ceiling of the adaptive policy")
    tau_floor: float = setting(0.9, "floor of the adaptive policy")
    max_tokens: int = setting(192, "longest answer, in tokens")
    api_key: str | None = setting(None, "the server's --api-key (the admin API needs it)")
    model: str | None = setting(None, "model name to send (default: the server's first)")
    timeout: float = setting(300.0, "seconds per request")
    deadline: float = setting(3600.0, "skip remaining runs after this many seconds")
    seed: int = setting(0, "seed of the toy test split")
    json_path: str | None = setting(None, "write the report as JSON to FILE", flag="--json", metavar="FILE")
    engine: str = setting(
        "marslm",
        "vllm: start vLLM servers on --checkpoint (plain, ngram and MARS, in the environment of "
        "`make vllm-env`) and compare vLLM plain AR, ngram, MARS lossless and MARS at --taus; "
        "--url and the policies do not apply",
        choices=NAMES,
    )
    checkpoint: str | None = setting(None, "with --engine vllm: the checkpoint to serve", metavar="DIR")
    taus: list = setting([0.95], "with --engine vllm: MARS taus", parse=floats)
    mask_batch_limit: int | None = setting(
        None,
        "with --engine vllm: the MARS server's --mask-batch-limit (plain steps above that many requests)",
        metavar="N",
    )
    repeats: int = setting(
        3,
        "interleaved rounds: each runs every level and every policy (vLLM: every server) once, "
        "side by side, so a shared machine's drift slows them alike",
    )
    vllm_args: tuple = setting(
        (),
        "with --engine vllm: options for every `vllm serve`, e.g. -- --gpu-memory-utilization 0.25",
        nargs="*",
        metavar="-- VLLM_ARGS",
    )

    def __post_init__(self):
        if self.json_path is not None:
            output_file(self.json_path, flag_of(LoadtestConfig, "json_path"))
        if engine(self.engine).starts_servers:
            if not self.checkpoint:
                raise UserError("--engine vllm needs --checkpoint DIR (the checkpoint the servers load)")
            self._check_load()
            for tau in self.taus:
                check_tau(tau, "prob")
            check_mask_batch_limit(self.mask_batch_limit, flag_of(LoadtestConfig, "mask_batch_limit"))
            return
        no_extra_args(self.vllm_args)
        if self.mask_batch_limit is not None:
            raise UserError("--mask-batch-limit is for --engine vllm; a marslm server takes its own at start")
        self._check_load()
        check_url(self.url)
        if not self.policies:
            raise UserError("--policies is empty")
        self.policy_bodies()

    def _check_load(self) -> None:
        """The load itself, whichever engine serves it."""
        if self.requests < 1 or self.repeats < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise UserError("--requests, --repeats and every --concurrency value must be >= 1")
        for name, value in [("requests", self.requests), ("repeats", self.repeats)] + [
            ("concurrency", c) for c in self.concurrency
        ]:
            check_count(flag_of(LoadtestConfig, name), value)
        if self.max_tokens < 1:
            raise UserError(f"{flag_of(LoadtestConfig, 'max_tokens')} must be >= 1, got {self.max_tokens}")
        for name in ("timeout", "deadline"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise UserError(f"{flag_of(LoadtestConfig, name)} must be a finite number of seconds > 0, got {value}")

    def policy_bodies(self) -> dict:
        """The ``POST /admin/policy`` body of each policy, by name (a bad policy or tau is refused)."""
        return {name: policy_settings(name, self.adaptive_tau, self.tau_floor) for name in self.policies}


def http_client(config: LoadtestConfig):
    """An ``httpx.AsyncClient`` with a connection for every worker of the highest level, and spares
    for the warm-up and admin calls."""
    import httpx

    connections = max(config.concurrency) + 4
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=config.timeout)


@dataclass(frozen=True)
class _Target:
    """The server under test, as every request reaches it."""

    client: Any  # an httpx.AsyncClient
    url: str
    headers: dict
    model: str


async def run_loadtest_async(config: LoadtestConfig, log=print) -> dict:
    from ..data import toy

    url = config.url.rstrip("/")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    bodies = config.policy_bodies()
    examples = toy.make_split("test", config.requests, seed=config.seed)
    stop_at = time.perf_counter() + config.deadline
    async with http_client(config) as client:
        server = _Target(client, url, headers, await _served_model(client, url, headers, config.model))
        original = await _admin_policy(server)
        try:
            await _warm_up(server, examples[0], config.timeout)
            runs = await _interleaved_runs(server, examples, bodies, config, stop_at, log)
            results = await _pooled_results(runs, examples, config, log)
        finally:
            await _admin_policy(
                server,
                {
                    "policy": original["policy"],
                    "tau": original["ceiling"],
                    "tau_floor": original["floor"],
                    "slo_ms": original["slo_ms"],
                },
            )
    if not any(r["ok"] for r in results):  # a report of nothing but errors would read as a result
        why = next((r["first_error"] for r in results if r["first_error"]), "no run started before --deadline")
        raise UserError(f"no request succeeded, so no report: {why}")
    _compare_with_tau1(results)
    return {
        "url": url,
        "model": server.model,
        "requests": len(examples),
        "repeats": config.repeats,
        "max_tokens": config.max_tokens,
        "data": "toy test split",
        "concurrency": list(config.concurrency),
        "policies": bodies,
        "results": results,
    }


async def _served_model(client, url: str, headers: dict, model: str | None) -> str:
    """``model``, or the first the server lists; refused when the server cannot be reached."""
    import httpx

    try:
        response = await client.get(url + "/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url}: {exc}") from None
    if response.status_code != 200:
        raise UserError(f"{url}/v1/models answered {answer_summary(response)}")
    try:
        served = response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise UserError(f"{url}/v1/models did not answer an OpenAI model list: is {url} a marslm server?") from None
    return model or served


async def _warm_up(server: _Target, example, timeout: float) -> None:
    """One unmeasured request: first-call costs (allocator, kernels) stay out of the numbers, and a
    request the server refuses (an unknown --model, say) is refused before the load."""
    warm = await one_request(server.client, server.url, server.headers, server.model, example.messages, 8, timeout)
    if not warm.ok:
        raise UserError(f"the server failed the first request, before any load was sent: {warm.error}")


async def _interleaved_runs(
    server: _Target, examples, bodies: dict, config: LoadtestConfig, stop_at: float, log
) -> dict:
    """``{(policy, concurrency): [(samples, wall), ...]}``, one entry per round that started
    before ``stop_at`` (a ``time.perf_counter()`` reading)."""
    runs: dict[tuple, list] = {}
    for round_, concurrency, name in itertools.product(range(config.repeats), config.concurrency, config.policies):
        if time.perf_counter() > stop_at:
            break
        # re-applied before every run: an adaptive tau starts each run at its ceiling
        await _admin_policy(server, bodies[name])
        samples, wall = await run_level(
            server.client,
            server.url,
            server.headers,
            server.model,
            examples,
            concurrency,
            config.max_tokens,
            config.timeout,
        )
        runs.setdefault((name, concurrency), []).append((samples, wall))
        log(
            f"loadtest: {round_ + 1}/{config.repeats} {name:>10} x{concurrency:<3} "
            f"{tokens_per_s(samples, wall):.0f} tok/s"
        )
    if time.perf_counter() > stop_at:
        log(f"loadtest: deadline of {config.deadline:.0f} s reached; the remaining runs were skipped")
    return runs


async def _pooled_results(runs: dict, examples, config: LoadtestConfig, log) -> list[dict]:
    """One result per policy and level that ran: its rounds' samples scored and summarised together."""
    from ..data import toy

    results = []
    for name, concurrency in itertools.product(config.policies, config.concurrency):
        if (name, concurrency) not in runs:
            continue
        rounds = runs[name, concurrency]
        samples = [s for round_samples, _ in rounds for s in round_samples]
        wall = sum(w for _, w in rounds)
        correct = await asyncio.to_thread(
            toy.score_many, examples * len(rounds), [s.text if s.ok else None for s in samples]
        )
        entry = {
            "policy": name,
            "concurrency": concurrency,
            "requests": len(samples),
            **summarise(samples, wall, correct),
            "tokens_per_s_rounds": [tokens_per_s(r, w) for r, w in rounds],
        }
        results.append(entry)
        log(
            f"loadtest: {name:>10} x{concurrency:<3} {entry['tokens_per_s']} tok/s, "
            f"p50 {entry['latency_s']['p50']} s, accuracy {entry['accuracy']}, errors {entry['errors']}"
        )
    return results


def _compare_with_tau1(results: list[dict]) -> None:
    """Add each result's accuracy change and speed-up against fixed tau 1 at its level, where that ran."""
    baseline = {r["concurrency"]: r for r in results if r["policy"] == "fixed-1.0"}
    for r in results:
        base = baseline.get(r["concurrency"])
        if base is None:
            continue
        if r["accuracy"] is not None and base["accuracy"] is not None:
            r["accuracy_delta_points"] = round(100 * (r["accuracy"] - base["accuracy"]), 2)
        # each round against fixed tau 1 in the same round: the machine's drift cancels
        ratios = [a / b for a, b in zip(r["tokens_per_s_rounds"], base["tokens_per_s_rounds"]) if a and b]
        r["speedup_vs_tau1"] = round(statistics.median(ratios), 3) if ratios else None


async def _admin_policy(server: _Target, body: dict | None = None) -> dict:
    """The server's tau policy: read it, or set it to ``body``."""
    url, headers = server.url + "/admin/policy", server.headers
    response = await (
        server.client.post(url, json=body, headers=headers)
        if body is not None
        else server.client.get(url, headers=headers)
    )
    if response.status_code != 200:
        raise UserError(
            f"{url} answered {answer_summary(response)} "
            "(the loadtest sets the tau policy through the admin API; pass --api-key if needed)"
        )
    try:
        return response.json()
    except ValueError:
        raise UserError(f"{url} did not answer JSON: is {server.url} a marslm server?") from None


def run_loadtest(config: LoadtestConfig, log=print) -> dict:
    return asyncio.run(run_loadtest_async(config, log))


def format_table(report: dict) -> str:
    rows = [
        "| policy | concurrency | req/s | tok/s | vs tau 1 | latency p50 / p90 / p99 (s) | TTFT p50 (s) | tok/fwd "
        "| accuracy | Δ vs tau 1 (pts) | errors |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lat = r["latency_s"]
        rows.append(
            f"| {r['policy']} | {r['concurrency']} | {_fmt(r['requests_per_s'])} | {_fmt(r['tokens_per_s'])} "
            f"| {_fmt(r.get('speedup_vs_tau1'))} "
            f"| {_fmt(lat['p50'])} / {_fmt(lat['p90'])} / {_fmt(lat['p99'])} | {_fmt(r['ttft_s']['p50'])} "
            f"| {_fmt(r['tokens_per_forward'])} | {_fmt(r['accuracy'])} "
            f"| {_fmt(r.get('accuracy_delta_points'))} | {r['errors']} |"
        )
    return "\n".join(rows)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) and abs(value) < 100 else str(value)


def loadtest(config: LoadtestConfig, log=print) -> tuple[dict, object]:
    """marslm's engine's side of ``marslm loadtest``: the server at ``--url``, per policy."""
    return run_loadtest(config, log=log), format_table
