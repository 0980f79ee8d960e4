"""``marslm serve`` as a real process on a free 127.0.0.1 port, driven by the official openai client
and by httpx: OpenAI compatibility, equivalence with offline decoding under concurrent load, bad
input, disconnects, the 429 path, the adaptive tau policy, the loadtest CLI and SIGTERM.

Two servers start in parallel: ``main`` (float64 weights so batching cannot flip a near-tie,
an API key, 8 rows) and ``small`` (1 row, a queue of 1: for the 429 and shutdown tests).
Every load loop is bounded in count and time and targets 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from marslm import generate
from marslm.data import toy
from tests.trained import TRAIN_N, find_long_prompt

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS_LIMIT = 1000


class ServerProcess:
    """``python -m marslm.cli serve --port 0 ...``; the port is read from its first log line.
    ``launcher`` replaces ``python -m marslm.cli`` (a script that patches the server first)."""

    def __init__(
        self, model_dir: Path, log_path: Path, *args: str, launcher: list[str] | None = None, log_level: str = "warning"
    ):
        self.log_path = log_path
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [
                *(launcher or [sys.executable, "-m", "marslm.cli"]),
                "serve",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--log-level",
                log_level,
                *args,
            ],
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if self.url is None:
                found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.log_path.read_text(errors="replace"))
                self.url = found.group(1) if found else None
            if self.url is not None:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy in time:\n{self.log()}")

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture(scope="module")
def servers(trained_dirs, tmp_path_factory):
    model_dir = trained_dirs["dir"] / "mars"
    logs = tmp_path_factory.mktemp("server_logs")
    started = {
        "main": ServerProcess(
            model_dir,
            logs / "main.log",
            "--dtype",
            "float64",
            "--max-batch",
            "8",
            "--api-key",
            KEY,
            "--max-tokens-limit",
            str(MAX_TOKENS_LIMIT),
            "--tau",
            "0.95",
            "--mask-batch-limit",  # so that a request's text does not depend on its batch (adaptive
            "off",  # width, the rest of the default fallback, is per row)
        ),
        "small": ServerProcess(model_dir, logs / "small.log", "--max-batch", "1", "--max-queue", "1"),
    }
    try:
        deadline = time.monotonic() + 60
        for server in started.values():
            server.wait_ready(deadline)
        yield started
    finally:
        codes = {name: server.terminate() for name, server in started.items()}
    assert codes == {"main": 0, "small": 0}, {name: s.log() for name, s in started.items()}


@pytest.fixture(scope="module")
def main_url(servers):
    return servers["main"].url


def test_the_start_line_says_what_answers_are_decoded_with(servers):
    lines = [line for line in servers["main"].log_path.read_text().splitlines() if "listening on" in line]
    assert "float64, eager, mask batch limit off" in lines[0]  # --dtype float64; the suite's MARSLM_COMPILE=off
    small = [line for line in servers["small"].log_path.read_text().splitlines() if "listening on" in line]
    assert "mask batch limit auto" in small[0]  # the default


@pytest.fixture(scope="module")
def mars64(trained_checkpoints):
    return trained_checkpoints["mars64"]


@pytest.fixture(scope="module")
def long_prompt(mars64):
    """A raw-text prompt the tiny model continues without EOS: a row that stays busy."""
    return find_long_prompt(*mars64, tokens=600)


@pytest.fixture(scope="module")
def messages():
    return [ex.messages for ex in toy.make_split("train", TRAIN_N, seed=0)]


def client(url: str, **kwargs):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60, **kwargs)


def metrics(url: str) -> dict:
    """Un-labelled and labelled samples of /metrics as {name or name{labels}: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def assert_healthy(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}


# ------------------------------------------------------------------------------ OpenAI client
def test_openai_client_chat_and_completions(main_url, messages):
    c = client(main_url)
    model = c.models.list().data[0].id
    chat = c.chat.completions.create(
        model=model, messages=messages[0], max_tokens=48, extra_body={"tau": 0.9, "block_size": 4, "mode": "threshold"}
    )
    text = chat.choices[0].message.content
    assert text and chat.choices[0].finish_reason in ("stop", "length")
    usage = chat.usage
    assert usage.completion_tokens > 0 and usage.prompt_tokens > 0
    assert usage.forwards >= 1 and usage.tokens_per_forward >= 1.0
    assert usage.forwards <= usage.completion_tokens + 1

    pieces, final_usage, finish = [], None, None
    for chunk in c.chat.completions.create(
        model=model,
        messages=messages[0],
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"tau": 0.9},
    ):
        if chunk.usage is not None:
            final_usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text  # greedy: streaming changes nothing
    assert finish == chat.choices[0].finish_reason
    assert final_usage.forwards == usage.forwards and final_usage.completion_tokens == usage.completion_tokens

    comp = c.completions.create(
        model=model, prompt="Sort the list [3, 1, 2].", max_tokens=16, extra_body={"tau": 0.8, "metric": "margin"}
    )
    assert comp.choices[0].finish_reason in ("stop", "length")
    assert comp.usage.forwards >= 1 and comp.usage.tokens_per_forward >= 1.0
    streamed = "".join(
        chunk.choices[0].text
        for chunk in c.completions.create(
            model=model,
            prompt="Sort the list [3, 1, 2].",
            max_tokens=16,
            stream=True,
            extra_body={"tau": 0.8, "metric": "margin"},
        )
        if chunk.choices
    )
    assert streamed == comp.choices[0].text

    # temperature samples the first token of each step (the masks keep the tau rule)
    sampled = c.chat.completions.create(model=model, messages=messages[0], max_tokens=16, temperature=1.5)
    assert sampled.usage.forwards >= 1 and sampled.choices[0].finish_reason in ("stop", "length")
    # lossless sampling with a seed: the same seed gives the same answer
    seeded = [
        c.chat.completions.create(
            model=model,
            messages=messages[0],
            max_tokens=24,
            temperature=1.0,
            top_p=0.9,
            seed=5,
            extra_body={"mode": "lossless"},
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]

    # stop strings: the answer ends right before the first one, streamed or not
    stop = [text[3:6], "\n"]
    stopped = c.chat.completions.create(
        model=model, messages=messages[0], max_tokens=48, stop=stop, extra_body={"tau": 0.9}
    )
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    assert stopped.choices[0].message.content == text[: min(ends)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed_stop = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in c.chat.completions.create(
            model=model, messages=messages[0], max_tokens=48, stop=stop, stream=True, extra_body={"tau": 0.9}
        )
        if chunk.choices
    )
    assert streamed_stop == text[: min(ends)]

    # the chat template is applied to completions only when asked
    templated = c.completions.create(
        model=model, prompt=messages[0][-1]["content"], max_tokens=48, extra_body={"tau": 0.9, "chat_template": True}
    )
    assert templated.choices[0].text == text


def test_models_health_metrics_and_auth(main_url):
    listed = httpx.get(main_url + "/v1/models", headers=AUTH, timeout=10).json()
    assert listed["data"][0]["block_size"] == 4 and listed["data"][0]["max_model_len"] == 1024
    assert_healthy(main_url)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/admin/tau")]:
            r = httpx.request(method, main_url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
    text = httpx.get(main_url + "/metrics", timeout=10).text
    for name in [
        "requests_total",
        "generation_tokens_total",
        "forwards_total",
        "tokens_per_forward",
        "queue_depth",
        "active_batch",
        "default_tau",
        "tau_policy",
        "tau_changes_total",
        "request_latency_seconds_bucket",
        "time_to_first_token_seconds_count",
        "step_latency_seconds_sum",
    ]:
        assert f"marslm_{name}" in text, name


# ------------------------------------------------------------------------------ equivalence
def test_64_concurrent_requests_equal_offline_generate(main_url, messages, mars64):
    """Requests join and leave an 8-row batch; each keeps its own settings and equals offline decoding."""
    model, tokenizer = mars64
    cases = []
    for i, msgs in enumerate(messages[:64]):
        extra = {"tau": [1.0, 0.95, 0.9, 0.8, 0.6][i % 5]}
        if i % 8 == 3:
            extra["block_size"] = 2 + (i // 8) % 2
        if i % 16 == 5:
            extra = {"mode": "lossless"}
        if i % 16 == 9:
            extra = {}  # follows the server's default tau (0.95, fixed)
        cases.append((msgs, [8, 24, 48, 64][i % 4], extra))

    async def run_all():
        c = openai.AsyncOpenAI(base_url=main_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(
                *(
                    c.chat.completions.create(model=model_name, messages=msgs, max_tokens=n, extra_body=extra)
                    for msgs, n, extra in cases
                )
            )
        finally:
            await c.close()

    model_name = client(main_url).models.list().data[0].id
    started = time.monotonic()
    responses = asyncio.run(run_all())
    assert time.monotonic() - started < 60
    for (msgs, n, extra), response in zip(cases, responses):
        ref = generate(
            model,
            tokenizer,
            [msgs],
            tau=extra.get("tau", 0.95),
            max_new_tokens=n,
            block_size=extra.get("block_size"),
            mode=extra.get("mode", "threshold"),
            mask_batch_limit=None,
        )
        assert response.choices[0].message.content == ref.texts[0], (n, extra)
        assert response.usage.completion_tokens == len(ref.token_ids[0])
        assert response.usage.forwards == ref.forwards[0], (n, extra)
    m = metrics(main_url)
    assert m["marslm_active_batch"] == 0 and m["marslm_queue_depth"] == 0


# ------------------------------------------------------------------------------ bad input
def test_bad_input_gets_openai_errors_and_the_server_stays_up(main_url, messages):
    user = messages[0]
    chat, comp = "/v1/chat/completions", "/v1/completions"
    cases = [
        (chat, b"{not json", 400, None),
        (chat, b"[1, 2]", 400, None),
        (chat, {"messages": "hello"}, 400, "messages"),
        (chat, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
        (chat, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        (chat, {"messages": user, "max_tokens": "ten"}, 400, "max_tokens"),
        (chat, {"messages": user, "temperature": "hot"}, 400, "temperature"),
        (chat, {"messages": user, "tau": "high"}, 400, "tau"),
        (chat, {"messages": user, "stream": "yes"}, 400, "stream"),
        (chat, {"model": 7, "messages": user}, 400, "model"),
        (chat, {}, 400, "messages"),
        (comp, {"max_tokens": 5}, 400, "prompt"),
        (comp, {"prompt": 12}, 400, "prompt"),
        (comp, {"prompt": ""}, 400, "prompt"),
        (comp, {"prompt": []}, 400, "prompt"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
        (chat, {"messages": user, "max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "max_tokens"),
        (chat, {"messages": user, "max_tokens": 0}, 400, "max_tokens"),
        (chat, {"messages": user, "tau": 1.5}, 400, "tau"),
        (chat, {"messages": user, "tau": 0}, 400, "tau"),
        (chat, {"messages": user, "tau": -1, "metric": "entropy"}, 400, "tau"),
        (chat, {"messages": user, "metric": "vibes"}, 400, "metric"),
        (chat, {"messages": user, "block_size": 5}, 400, "block_size"),
        (chat, {"messages": user, "mode": "fast"}, 400, "mode"),
        (chat, {"messages": user, "n": 2}, 400, "n"),
        (chat, {"messages": user, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (chat, {"messages": user, "stop": 3}, 400, "stop"),
        (chat, {"messages": user, "top_p": 0}, 400, "top_p"),
        (chat, {"messages": user, "seed": -1}, 400, "seed"),
        (chat, {"messages": user, "temperature": 3}, 400, "temperature"),
        (comp, {"prompt": "word " * 1100, "max_tokens": 8}, 400, "prompt"),
        (comp, {"prompt": "word " * 150, "max_tokens": 800}, 400, "max_tokens"),  # ~450 + 800 > 1024
        (chat, {"model": "gpt-4", "messages": user}, 404, "model"),
        ("/v1/nothing", {}, 404, None),
    ]
    for path, body, status, param in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(
            main_url + path, content=content, headers={**AUTH, "Content-Type": "application/json"}, timeout=10
        )
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["param"] == param, (body, error)
        assert_healthy(main_url)
    long_prompt_error = httpx.post(main_url + comp, json={"prompt": "word " * 1100}, headers=AUTH, timeout=10).json()
    assert long_prompt_error["error"]["code"] == "context_length_exceeded"


# ------------------------------------------------------------------------------ disconnects
def test_client_disconnect_frees_its_batch_slot(main_url, long_prompt):
    def wait_until_freed(cancelled_before):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = metrics(main_url)
            if m['marslm_requests_total{status="cancelled"}'] == cancelled_before + 1 and m["marslm_active_batch"] == 0:
                return cancelled_before + 1
            time.sleep(0.05)
        pytest.fail(f"the slot was not freed: {m}")

    cancelled = metrics(main_url)['marslm_requests_total{status="cancelled"}']
    body = {"prompt": long_prompt, "max_tokens": 900, "tau": 1.0, "stream": True}
    with httpx.stream("POST", main_url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one piece of text, then hang up
    cancelled = wait_until_freed(cancelled)

    # without streaming: the client gives up waiting for the whole answer
    with pytest.raises(httpx.TimeoutException):
        httpx.post(main_url + "/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=0.3)
    wait_until_freed(cancelled)
    assert_healthy(main_url)


# ------------------------------------------------------------------------------ tau policy
def test_adaptive_tau_falls_under_a_burst_and_recovers(main_url, messages):
    admin = httpx.Client(base_url=main_url, headers=AUTH, timeout=10)
    state = admin.post("/admin/policy", json={"policy": "adaptive", "tau": 0.95, "tau_floor": 0.8}).json()
    assert state["policy"] == "adaptive" and state["tau"] == 0.95
    m = metrics(main_url)
    assert m['marslm_tau_policy{policy="adaptive"}'] == 1 and m["marslm_default_tau"] == 0.95
    down_before = m['marslm_tau_changes_total{direction="down"}']
    up_before = m['marslm_tau_changes_total{direction="up"}']

    async def burst():  # 40 requests on 8 rows: a queue of up to 32
        async with httpx.AsyncClient(base_url=main_url, headers=AUTH, timeout=60) as c:
            return await asyncio.gather(
                *(c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 64}) for msgs in messages[:40])
            )

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    m = metrics(main_url)
    assert m['marslm_tau_changes_total{direction="down"}'] > down_before  # it fell under the burst
    deadline = time.monotonic() + 15
    while metrics(main_url)["marslm_default_tau"] != 0.95:  # ... and comes back
        assert time.monotonic() < deadline, "default tau did not recover"
        time.sleep(0.2)
    assert metrics(main_url)['marslm_tau_changes_total{direction="up"}'] > up_before

    # live admin change of the default, visible at once; then back to the fixed policy
    assert admin.post("/admin/tau", json={"tau": 0.9}).json()["tau"] == 0.9
    assert metrics(main_url)["marslm_default_tau"] == 0.9
    assert admin.post("/admin/tau", json={"tau": 2}).status_code == 400
    assert admin.post("/admin/policy", json={"policy": "sometimes"}).status_code == 400
    assert admin.post("/admin/policy", json={"tau_floor": 0.99}).status_code == 400
    state = admin.post("/admin/policy", json={"policy": "fixed", "tau": 0.95, "tau_floor": 0.8}).json()
    assert (state["policy"], state["tau"]) == ("fixed", 0.95)


# ------------------------------------------------------------------------------ loadtest CLI
def test_loadtest_cli_reports_every_policy(main_url, tmp_path):
    out = tmp_path / "load.json"
    before = httpx.get(main_url + "/admin/policy", headers=AUTH, timeout=10).json()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "marslm.cli",
            "loadtest",
            "--url",
            main_url,
            "--concurrency",
            "1,4",
            "--requests",
            "4",
            "--repeats",
            "2",
            "--max-tokens",
            "32",
            "--api-key",
            KEY,
            "--json",
            str(out),
            "--deadline",
            "60",
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| policy | concurrency |" in run.stdout
    report = json.loads(out.read_text())
    runs = [(r["policy"], r["concurrency"]) for r in report["results"]]
    assert runs == [(p, c) for p in ("fixed-1.0", "fixed-0.95", "adaptive") for c in (1, 4)]
    assert report["repeats"] == 2
    for r in report["results"]:
        assert r["ok"] == 8 and r["errors"] == 0 and len(r["tokens_per_s_rounds"]) == 2
        assert r["speedup_vs_tau1"] > 0
        assert 0 <= r["accuracy"] <= 1 and "accuracy_delta_points" in r
        assert r["tokens_per_s"] > 0 and r["latency_s"]["p50"] > 0 and r["tokens_per_forward"] >= 1
    after = httpx.get(main_url + "/admin/policy", headers=AUTH, timeout=10).json()
    assert {k: after[k] for k in ("policy", "tau", "floor")} == {k: before[k] for k in ("policy", "tau", "floor")}


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--model", "nope"], "failed the first request, before any load was sent: 404"),
        (["--max-tokens", str(MAX_TOKENS_LIMIT + 1)], "no request succeeded, so no report: 400"),
    ],
)
def test_a_loadtest_where_every_request_fails_writes_no_report(main_url, tmp_path, capsys, flags, fragment):
    from tests.cli.test_errors import run

    out = tmp_path / "load.json"
    finished = metrics(main_url)['marslm_requests_total{status="finished"}']
    common = ["--url", main_url, "--api-key", KEY, "--policies", "fixed-1.0", "--concurrency", 1, "--requests", 2]
    rc, stdout, err = run(capsys, "loadtest", *common, "--repeats", 1, "--json", out, *flags)
    *progress, last = err.strip().splitlines()  # the progress lines, then the one line that says why
    assert rc == 2 and last.startswith("marslm loadtest: error: ") and fragment in last, err
    assert all(line.startswith("loadtest: ") for line in progress), err
    assert not out.exists() and "| policy |" not in stdout
    if "--model" in flags:  # refused by the first request: no load reached the engine
        assert metrics(main_url)['marslm_requests_total{status="finished"}'] == finished


# ------------------------------------------------------------------------------ 429 and shutdown
def test_full_queue_answers_429_with_retry_after(servers, long_prompt):
    url = servers["small"].url  # 1 row, a queue of 1

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            body = {"prompt": long_prompt, "max_tokens": 600, "tau": 1.0, "stream": True}
            requests = [c.build_request("POST", "/v1/completions", json=body) for _ in range(6)]
            responses = await asyncio.gather(*(c.send(r, stream=True) for r in requests))
            statuses = []
            for r in responses:
                # read the refusals; hang up on the accepted ones (their rows are freed)
                content = await r.aread() if r.status_code != 200 else b""
                statuses.append((r.status_code, r.headers.get("retry-after"), content))
                await r.aclose()
            return statuses

    statuses = asyncio.run(burst())
    refused = [s for s in statuses if s[0] == 429]
    assert refused and any(s[0] == 200 for s in statuses), statuses
    for _, retry_after, content in refused:
        assert int(retry_after) >= 1
        assert json.loads(content)["error"]["type"] == "rate_limit_error"
    assert_healthy(url)


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(servers, long_prompt):
    server = servers["small"]
    body = {
        "prompt": long_prompt,
        "max_tokens": 300,
        "tau": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks, done = [], False
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 2:
                    server.proc.send_signal(signal.SIGTERM)  # mid-stream
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    usage = chunks[-1]["usage"]
    assert done and (finish == "stop" or usage["completion_tokens"] == 300)  # it ran to its end
    assert server.terminate(timeout=30) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2)
