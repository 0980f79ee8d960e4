"""Every error is one line: a command line argparse refuses, a checkpoint without a mask token, a
server that answers HTML or not JSON, a report of the wrong types, a reader that closes the pipe;
and a flag that does nothing useful with the checkpoint given warns in one line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from marslm.mars_json import MarsConfig
from tests.cli.test_bounds import no_model_loads  # noqa: F401 - a fixture
from tests.cli.test_errors import assert_one_line_error, run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict:
    """The tiny random model as an AR checkpoint, and as one without a mask token (its tokenizer
    knows no <|mask|>, and no marslm.json names one)."""
    root = tmp_path_factory.mktemp("one-line")
    ar = root / "ar"
    shutil.copytree(tiny_model_dir, ar)
    MarsConfig(stage="ar", block_size=1).save(ar)
    maskless = root / "maskless"
    shutil.copytree(tiny_model_dir, maskless)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        file = maskless / name
        if file.is_file():
            file.write_text(file.read_text().replace("<|mask|>", "<|spare|>"))
    return {"ar": ar, "maskless": maskless}


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["generate", "--model", "m", "--prompt", "p", "--max-new-tokens", "1e11"], "invalid int value: '1e11'"),
        (["bench", "--model", "m", "--n", "many"], "invalid int value: 'many'"),
        (["eval", "--model", "m", "--tau", "high"], "expected comma-separated numbers"),
        (["probe", "--model", "m", "--data", "d", "--batch-size", "2.5"], "invalid int value: '2.5'"),
        (["loadtest", "--requests", "x"], "invalid int value: 'x'"),
        (["show", "--model", "m", "--prompt", "p", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_a_refused_command_line_is_one_line_and_a_help_hint(capsys, argv, fragment):
    from marslm import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and fragment in err, err
    top_level = argv[0] == "nonsense" or "unrecognized" in fragment  # the main parser's refusals
    command = "marslm" if top_level else f"marslm {argv[0]}"
    assert err.startswith(f"{command}: error: ") and err.strip().endswith(f"(see {command} --help)"), err


@pytest.mark.usefixtures("no_model_loads")
def test_generate_refuses_a_checkpoint_without_a_mask_token_in_one_line(checkpoints, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="marslm"):
        rc, out, err = run(capsys, "generate", "--model", checkpoints["maskless"], "--prompt", "hi", "--tau", "0.9")
    assert_one_line_error(rc, err, "the model has no mask token to decode with")
    assert caplog.records == [] and out == ""  # no "has no marslm.json" line before it


@pytest.mark.usefixtures("no_model_loads")
def test_eval_refuses_a_checkpoint_without_a_mask_token_up_front(checkpoints, capsys, tmp_path):
    report = tmp_path / "report.json"
    model = checkpoints["maskless"]
    rc, _, err = run(capsys, "eval", "--model", model, "--tau", "1,0.9", "--n", 2, "--json", report, "--quiet")
    assert_one_line_error(rc, err, f"{model}: the model has no mask token to decode with")
    assert not report.exists()


def test_bench_warns_about_an_ar_checkpoint_as_generate_does(checkpoints, capsys, caplog, monkeypatch):
    from marslm import modeling
    from marslm.errors import UserError

    def stop(*args, **kwargs):
        raise UserError("stopped before loading")

    monkeypatch.setattr(modeling, "load_model", stop)
    ar = checkpoints["ar"]
    with caplog.at_level(logging.WARNING, logger="marslm"):
        rc, _, err = run(capsys, "bench", "--model", ar, "--ar-model", ar, "--n", 2, "--quiet")
    assert_one_line_error(rc, err, "stopped before loading")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "is an AR checkpoint (marslm.json stage 'ar')" in warnings[0], warnings
    assert "\n" not in warnings[0]


@pytest.mark.parametrize(
    "cell, fragment",
    [
        ({"tau": "0.9"}, "a result's tau must be a number, got '0.9'"),
        ({"accuracy": None}, "a result's accuracy must be a number, got None"),
        ({"families": "arithmetic"}, "a result's families must map each family"),
        ({"families": {"arithmetic": {"accuracy": "high", "n": 1, "tokens_per_forward": 1.0}}}, "families must map"),
        ({"metric": 3}, "a result's metric must be a string, got 3"),
    ],
)
def test_plot_checks_the_types_of_a_report(capsys, tmp_path, cell, fragment):
    good = {"tau": 0.9, "metric": "prob", "block_size": 4, "accuracy": 0.5, "tokens_per_forward": 1.5}
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"model": "m", "data": "toy", "results": [{**good, **cell}]}))
    out = tmp_path / "plot.png"
    rc, _, err = run(capsys, "plot", report, "--out", out)
    assert_one_line_error(rc, err, fragment)
    assert not out.exists()


class _Server(BaseHTTPRequestHandler):
    """Answers GET /v1/models as ``self.server.answer`` says: (status, content type, body)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        status, kind, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    """``fake_server(status, content_type, body) -> url`` of a local server answering every GET so."""
    servers = []

    def start(status: int, kind: str, body: bytes) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
        server.answer = (status, kind, body)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


HTML_404 = (
    b"<!DOCTYPE html>\n<html>\n<head><title>404 Not Found</title></head>\n"
    b"<body>\n<h1>Not Found</h1>\n</body>\n</html>\n"
)


@pytest.mark.parametrize(
    "answer, fragment",
    [
        ((404, "text/html", HTML_404), "/v1/models answered 404 Not Found"),
        ((200, "text/plain", b"hello\nworld\n"), "/v1/models did not answer an OpenAI model list"),
        ((200, "application/json", b'{"data": []}'), "/v1/models did not answer an OpenAI model list"),
        ((500, "application/json", b'{"error": {"message": "engine\\ndown"}}'), "answered 500 Internal Server Error"),
    ],
)
def test_loadtest_reports_a_strange_server_in_one_line(capsys, fake_server, answer, fragment):
    url = fake_server(*answer)
    rc, _, err = run(capsys, "loadtest", "--url", url, "--requests", 2, "--concurrency", 1, "--repeats", 1)
    assert_one_line_error(rc, err, fragment)
    assert "<html>" not in err and "<h1>" not in err


@pytest.mark.parametrize(
    "url, fragment",
    [("http://[::1", "--url 'http://[::1' is not a valid URL"), ("localhost:8000", "--url must be an http://")],
)
def test_loadtest_refuses_a_malformed_url_in_one_line(capsys, url, fragment):
    rc, _, err = run(capsys, "loadtest", "--url", url)
    assert_one_line_error(rc, err, fragment)


def test_probe_into_a_closed_pipe_ends_without_a_traceback(tiny_model_dir, tmp_path, write_chat_jsonl):
    data = write_chat_jsonl(tmp_path / "held-out.jsonl", 4)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "marslm.cli", "probe", "--model", str(tiny_model_dir), "--data", str(data), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    proc.stdout.close()  # the reader is gone before the report is printed (`marslm probe --json | true`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err and "No module" not in err, err
