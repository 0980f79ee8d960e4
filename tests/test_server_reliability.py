"""``marslm serve`` against hostile-but-bounded clients: oversized and deeply nested bodies, slow
and many connections, clients that hang up, bad admin values, and a shutdown that cuts requests
off. Real server processes on 127.0.0.1, raw sockets where a client must misbehave.

The ``guarded`` server is started through a small launcher that patches two functions where the
server looks them up: the request parser raises for a marked request (a stand-in for a bug: a
500), and the prompt's tokenization waits, for a marked prompt, until the test releases it (to
show tokenizing does not hold up the event loop)."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import ServerProcess, assert_healthy
from tests.trained import find_long_prompt

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 1, 2, 12
MIB = 2**20

HELD_PROMPT = "Bob has"  # its tokenization waits for the test's release file
LAUNCHER = rf"""
import sys, time
from pathlib import Path
import marslm.serve.app as app
import marslm.serve.openai as openai_objects

release = Path(sys.argv[1])
real_parse, real_encode = app.parse_options, openai_objects.encode_prompt

def parse_options(body, chat):
    if body.get("user") == "raise-500":
        raise RuntimeError("a bug, raised on purpose by the test launcher")
    return real_parse(body, chat)

def encode_prompt(tokenizer, prompt, *args):
    if prompt == {HELD_PROMPT!r}:
        while not release.exists():
            time.sleep(0.02)
    return real_encode(tokenizer, prompt, *args)

app.parse_options, openai_objects.encode_prompt = parse_options, encode_prompt
from marslm.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def guarded(trained_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("guarded")
    launcher = root / "launcher.py"
    launcher.write_text(LAUNCHER)
    release = root / "release"
    server = ServerProcess(
        trained_dirs["dir"] / "mars",
        root / "server.log",
        "--max-batch",
        "2",
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
        "--body-timeout",
        str(BODY_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
        launcher=[sys.executable, str(launcher), str(release)],
        log_level="info",
    )
    try:
        server.wait_ready(time.monotonic() + 60)
        server.release = release
        server.bugs = 0  # deliberate 500s: each logs one traceback
        yield server
    finally:
        code = server.terminate()
    log = server.log_path.read_text()
    assert code == 0, log[-3000:]
    # the deliberate bugs are the only tracebacks; no disconnect or cancellation ever printed one
    assert log.count("Traceback") == server.bugs and "ClientDisconnect" not in log and "CancelledError" not in log, log[
        -5000:
    ]


@pytest.fixture(scope="module")
def long_prompt(trained_checkpoints) -> str:
    """Raw text the model continues for 600 tokens: a row that stays busy."""
    return find_long_prompt(*trained_checkpoints["mars64"], tokens=600)


def address(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].rsplit(":", 1)
    return host, int(port)


def exchange(url: str, data: bytes, wait: float = 30.0) -> bytes:
    """Send ``data`` on a fresh connection, then read until the server closes it (or ``wait`` runs out)."""
    with socket.create_connection(address(url)) as sock:
        sock.settimeout(wait)
        try:
            sock.sendall(data)
        except OSError:  # the server may close before taking it all: that is the point
            pass
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            received += b"<still open>"
        except OSError:
            pass
        return received


def response_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def head(path: str, length: int | None = None, chunked: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += ["Transfer-Encoding: chunked"] if chunked else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ------------------------------------------------------------------------------ request size
def test_oversized_bodies_are_refused_as_they_arrive(guarded):
    # declared too large: refused after the headers, with a tenth of the body sent
    status, error = response_json(exchange(guarded.url, head("/v1/completions", 2 * MIB) + b"x" * (MIB // 5)))
    assert status == 413 and error["error"]["code"] == "request_too_large"
    # chunked, no length: refused once the running total passes the limit, not at the end
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"x" * 64 * 1024)
    raw = exchange(guarded.url, head("/v1/completions", chunked=True) + chunk * 20)  # 1.25 MiB, no final chunk
    status, error = response_json(raw)
    assert status == 413 and error["error"]["type"] == "invalid_request_error"
    assert_healthy(guarded.url)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(guarded):
    big = "apple banana 12, " * 50_000  # 850 kB, under the limit
    for path, body in [
        ("/v1/completions", {"prompt": big}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
    ]:
        r = httpx.post(guarded.url + path, json=body, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "characters" in error["message"]  # the bound on characters, not a token count
    # a token-id prompt is counted as it is
    r = httpx.post(guarded.url + "/v1/completions", json={"prompt": [5] * 100_000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_memory_returns_to_its_baseline_after_large_requests(guarded):
    client = httpx.Client(base_url=guarded.url, timeout=60)
    filler = "apple banana cherry 12 34, " * 40_000  # about 1 MB of text
    bodies = [
        {"messages": [{"role": "user", "content": filler[: MIB - 200]}]},
        {"prompt": list(range(300)) * 600},  # 180k token ids
        {"prompt": filler[:20_000], "max_tokens": 4},  # tokenized, then refused
        {"prompt": "x" * (MIB + 10)},
    ]  # 413
    for body in bodies:  # warm up every path
        client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
    baseline = rss_mb(guarded.proc.pid)
    for _ in range(8):
        for body in bodies:
            r = client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
            assert r.status_code in (400, 413)
    assert rss_mb(guarded.proc.pid) < baseline + 64


def test_parsing_and_tokenizing_do_not_hold_up_the_event_loop(guarded):
    """A request whose tokenization is held (by the launcher, until the test releases it): the
    event loop still answers /health and streams other answers meanwhile."""
    result = {}

    def slow_request():
        result["response"] = httpx.post(
            guarded.url + "/v1/completions",
            timeout=120,
            json={"prompt": HELD_PROMPT, "max_tokens": 4},
        )

    thread = threading.Thread(target=slow_request)
    thread.start()
    try:
        time.sleep(0.3)
        assert_healthy(guarded.url)
        other = httpx.post(guarded.url + "/v1/completions", json={"prompt": "Ana has", "max_tokens": 4}, timeout=60)
        assert other.status_code == 200
        assert thread.is_alive() and "response" not in result  # the held request is still held
    finally:
        guarded.release.touch()
        thread.join(60)
    assert result["response"].status_code == 200


# ------------------------------------------------------------------------------ nesting, errors, keep-alive
def test_errors_answer_json_and_keep_the_connection(guarded):
    deep = b"[" * 100_000 + b"]" * 100_000
    bug = json.dumps({"prompt": "Ana has", "user": "raise-500"}).encode()
    with socket.create_connection(address(guarded.url)) as sock:
        sock.settimeout(30)
        reader = sock.makefile("rb")

        def ask(request: bytes) -> tuple[int, dict]:
            sock.sendall(request)
            status = int(reader.readline().split(b" ", 2)[1])
            length = 0
            while (line := reader.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
                assert not (name.lower() == "connection" and "close" in value.lower()), line
            return status, json.loads(reader.read(length))

        status, body = ask(head("/v1/completions", len(deep)) + deep)
        assert status == 400 and "nested too deeply" in body["error"]["message"]
        guarded.bugs += 1
        status, body = ask(head("/v1/completions", len(bug)) + bug)
        assert status == 500 and body["error"]["type"] == "server_error"
        status, body = ask(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")  # same connection, still open
        assert (status, body) == (200, {"status": "ok"})


# ------------------------------------------------------------------------------ admin
def test_admin_values_are_checked_before_they_apply(guarded):
    admin = httpx.Client(base_url=guarded.url, timeout=10, headers={"Content-Type": "application/json"})
    before = admin.get("/admin/policy").json()
    for raw in (
        b'{"slo_ms": Infinity}',
        b'{"slo_ms": 1e999}',
        b'{"slo_ms": NaN}',
        b'{"slo_ms": -5}',
        b'{"tau": Infinity}',
        b'{"tau_floor": NaN}',
    ):
        r = admin.post("/admin/policy", content=raw)
        assert r.status_code == 400 and r.json()["error"]["message"], raw
        assert admin.get("/admin/policy").json() == before  # nothing applied
    assert admin.post("/admin/tau", content=b'{"tau": Infinity}').status_code == 400
    # what is accepted is applied exactly: no rounding to 0.01
    assert admin.post("/admin/tau", json={"tau": 0.004}).json()["tau"] == 0.004
    state = admin.post("/admin/policy", json={"policy": "adaptive", "tau": 0.123456, "tau_floor": 0.1}).json()
    assert (state["tau"], state["ceiling"], state["floor"]) == (0.123456, 0.123456, 0.1)
    admin.post(
        "/admin/policy",
        json={
            "policy": before["policy"],
            "tau": before["ceiling"],
            "tau_floor": before["floor"],
            "slo_ms": before["slo_ms"],
        },
    )
    assert admin.get("/admin/policy").json()["tau"] == before["tau"]


# ------------------------------------------------------------------------------ slow and many clients
def test_slow_and_many_clients_are_cut_off(guarded):
    # half a request head: the connection is closed at the header deadline
    assert exchange(guarded.url, b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n") == b""
    # a whole head, a tenth of the body: 408 at the body deadline
    status, error = response_json(exchange(guarded.url, head("/v1/completions", 100) + b'{"prompt": "A'))
    assert status == 408 and error["error"]["code"] == "request_timeout"
    # more connections than allowed: the extra ones are answered 503 and closed
    sockets = [socket.create_connection(address(guarded.url)) for _ in range(MAX_CONNECTIONS + 3)]
    try:
        refused = 0
        for sock in sockets:
            sock.settimeout(30)
            reply = sock.recv(4096)  # the extra ones get a 503; the others are closed by the header deadline
            refused += reply.startswith(b"HTTP/1.1 503")
        assert refused >= 3
    finally:
        for sock in sockets:
            sock.close()
    assert_healthy(guarded.url)


def test_client_disconnects_are_one_log_line(guarded, long_prompt):
    # hang up in the middle of sending a body
    with socket.create_connection(address(guarded.url)) as sock:
        sock.sendall(head("/v1/completions", 1000) + b'{"prompt": ')
        time.sleep(0.3)
    # hang up while waiting for a whole (non-streamed) answer
    # 600 tokens take about half a second on a 2-core CPU: the client gives up long before that
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            guarded.url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 600, "tau": 1.0}, timeout=0.1
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = guarded.log_path.read_text()
        if "went away while sending its request" in log and "went away before its answer was ready" in log:
            break
        time.sleep(0.1)
    else:
        pytest.fail(guarded.log_path.read_text()[-3000:])
    assert "ClientDisconnect" not in log
    assert_healthy(guarded.url)


def test_metrics_name_the_served_model_not_its_path(guarded, trained_dirs):
    text = httpx.get(guarded.url + "/metrics", timeout=10).text
    assert 'marslm_model_info{model="mars"} 1' in text
    assert str(trained_dirs["dir"]) not in text
    assert httpx.get(guarded.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "mars"


# ------------------------------------------------------------------------------ shutdown
def test_requests_cut_off_by_shutdown_get_503(trained_dirs, tmp_path, long_prompt):
    server = ServerProcess(
        trained_dirs["dir"] / "mars",
        tmp_path / "server.log",
        "--max-batch",
        "1",
        "--shutdown-timeout",
        "0",
        log_level="info",
    )
    try:
        server.wait_ready(time.monotonic() + 60)
        waiting = {}

        def queued_request():  # waits for the one batch row, behind the stream
            waiting["response"] = httpx.post(
                server.url + "/v1/completions", timeout=60, json={"prompt": long_prompt, "max_tokens": 600, "tau": 1.0}
            )

        events, done = [], False
        body = {"prompt": long_prompt, "max_tokens": 600, "tau": 1.0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    break
            thread = threading.Thread(target=queued_request)
            thread.start()
            deadline = time.monotonic() + 30
            while "marslm_queue_depth 1" not in httpx.get(server.url + "/metrics", timeout=10).text:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        thread.join(60)
        assert done and events[-1]["error"]["code"] == "shutting_down"  # the stream says why it ended
        response = waiting["response"]
        assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
        assert server.terminate(timeout=30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.log_path.read_text()
    assert "Traceback" not in log and "Internal Server Error" not in log, log[-3000:]
