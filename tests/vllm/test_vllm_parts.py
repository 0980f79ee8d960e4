"""The vLLM plugin's parts that run without vLLM: settings, engine arguments, the HTTP middleware,
the launcher's errors. (The engine itself: test_vllm_engine.py.)"""

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from marslm.decode.params import ParamError, metric_code
from marslm.vllm import engine_args, middleware
from marslm.vllm.engine_args import (
    GIB,
    PROPOSER,
    SCHEDULER,
    cpu_kv_cache_default,
    cpu_kv_cache_gib,
    engine_kwargs,
    plugin_config,
    server_args,
)
from marslm.vllm.request_settings import (
    LOSSLESS,
    OFF,
    THRESHOLD,
    PluginConfig,
    RowSettings,
    check_request,
    row_settings,
)

MARS = PluginConfig(mask_token_id=3, num_masks=4, tau=0.95)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tau": 0.9},
        {"tau": 1},
        {"tau": 0.5, "metric": "margin"},
        {"tau": 0.7, "metric": "entropy"},
        {"mode": "lossless"},
        {"other": "kept"},
    ],
)
def test_check_request_accepts(fields):
    check_request(fields)


@pytest.mark.parametrize(
    "fields, greedy, param",
    [
        ({"tau": "0.9"}, True, "tau"),
        ({"tau": True}, True, "tau"),
        ({"tau": 0}, True, "tau"),
        ({"tau": 1.01}, True, "tau"),
        ({"tau": -0.1, "metric": "entropy"}, True, "tau"),
        ({"metric": "entropy"}, True, "tau"),
        ({"metric": "confidence"}, True, "metric"),
        ({"mode": "greedy"}, True, "mode"),
        ({"tau": 0.9}, False, "temperature"),
    ],
)
def test_check_request_refuses(fields, greedy, param):
    with pytest.raises(ParamError) as info:
        check_request(fields, greedy=greedy)
    assert info.value.param == param


@pytest.mark.parametrize(
    "fields",
    [{"tau": "high"}, {"tau": True}, {"tau": 1.5}, {"metric": "nope"}, {"metric": 3}, {"mode": "fast"}]
    + [{"metric": "entropy"}],
)
def test_the_vllm_front_door_refuses_a_field_as_marslm_serve_does(fields):
    from marslm.serve.openai import parse_options
    from marslm.serve.requests import RequestLimits

    with pytest.raises(ParamError) as vllm:
        check_request(fields)
    with pytest.raises(ParamError) as serve:
        params, _, _ = parse_options(fields, chat=True)
        RequestLimits(None, 16, 16, 4).resolve([1], params, 0.95)
    assert (str(vllm.value), vllm.value.param, vllm.value.code) == (
        str(serve.value),
        serve.value.param,
        serve.value.code,
    )


def test_row_settings():
    prob, margin = metric_code("prob"), metric_code("margin")
    assert row_settings(None, True, MARS) == RowSettings(THRESHOLD, 0.95, prob)  # the server's default tau
    assert row_settings({"tau": 0.8, "metric": "margin"}, True, MARS) == RowSettings(THRESHOLD, 0.8, margin)
    assert row_settings({"mode": "lossless"}, True, MARS).mode == LOSSLESS
    assert row_settings({"tau": 1.0}, True, MARS).mode == OFF  # one-token mode: plain vLLM
    assert row_settings({"tau": 0.0, "metric": "entropy"}, True, MARS).mode == OFF
    assert row_settings(None, False, MARS).mode == OFF  # a sampling request
    assert row_settings({"tau": 0.5}, True, PluginConfig()).mode == OFF  # a checkpoint without masks


def test_engine_kwargs(trained_dirs):
    mars = trained_dirs["dir"] / "mars"
    kwargs = engine_kwargs(mars, cpu=True)
    assert kwargs["speculative_config"] == {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 8}
    assert kwargs["additional_config"]["marslm"]["mask_token_id"] == plugin_config(mars).mask_token_id
    assert kwargs["scheduler_cls"] == SCHEDULER and kwargs["enforce_eager"] and kwargs["block_size"] == 32
    args = server_args(kwargs)
    assert (
        args[0] == str(mars)
        and "--enforce-eager" in args
        and args[-2:] == ["--middleware", middleware.__name__ + ".MarsMiddleware"]
    )
    assert json.loads(args[args.index("--speculative-config") + 1]) == kwargs["speculative_config"]
    # a plain AR checkpoint is served by vLLM as it is: no drafts, no plugin scheduler
    assert engine_kwargs(trained_dirs["dir"] / "ar") == {"model": str(trained_dirs["dir"] / "ar")}
    assert engine_kwargs(mars, speculative="ngram")["speculative_config"]["method"] == "ngram"


# Qwen2.5-0.5B's shape: 24 layers x 2 key/value heads x 64 x (keys, values) x 4 bytes = 24 KiB a token
QWEN_05B = dict(
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896, max_position_embeddings=32768
)


def test_the_cpu_kv_cache_is_sized_from_the_model():
    # 16 sequences of the whole context (768 MiB each), with a quarter on top
    assert cpu_kv_cache_gib(QWEN_05B, max_num_seqs=16) == 15
    assert cpu_kv_cache_gib(QWEN_05B, max_model_len=4096, max_num_seqs=16) == 2  # 1.875 GiB, rounded up
    # on a shared machine: at most half of what is available, but always one whole sequence
    assert cpu_kv_cache_gib(QWEN_05B, max_num_seqs=16, available_bytes=8 * GIB) == 4
    assert cpu_kv_cache_gib(QWEN_05B, max_model_len=65536, max_num_seqs=16, available_bytes=GIB) == 2  # 1.875
    assert cpu_kv_cache_gib({**QWEN_05B, "num_hidden_layers": 2, "max_position_embeddings": 1024}) == 1


def test_the_cpu_kv_cache_follows_the_options_that_size_it(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    monkeypatch.setattr(engine_args, "_available_memory", lambda: None)
    assert cpu_kv_cache_default(tmp_path, max_num_seqs=16) == 15
    assert cpu_kv_cache_default(tmp_path, ["--max-model-len", "4096", "--max-num-seqs=16"], max_num_seqs=64) == 2
    assert cpu_kv_cache_default("Qwen/Qwen2.5-0.5B") is None  # a hub id: vLLM's own default


def test_rewrite_request_moves_fields():
    body = json.loads(
        middleware.rewrite_request(
            json.dumps({"messages": [], "tau": 0.8, "mode": "lossless", "vllm_xargs": {"other": 1}}).encode()
        )
    )
    assert body == {"messages": [], "vllm_xargs": {"other": 1, "tau": 0.8, "mode": "lossless"}}
    untouched = b'{"messages": [], "temperature": 0.7}'
    assert middleware.rewrite_request(untouched) == untouched
    assert middleware.rewrite_request(b"not json") == b"not json"
    with pytest.raises(ParamError, match="block_size"):
        middleware.rewrite_request(b'{"block_size": 2}')
    with pytest.raises(ParamError, match="greedy"):
        middleware.rewrite_request(b'{"tau": 0.9, "temperature": 1.0}')


def test_add_forwards():
    payload = {"usage": {"completion_tokens": 12}, "metrics": {"speculative_decoding": {"num_spec_steps": 5}}}
    assert middleware.add_forwards(payload)["usage"] == {
        "completion_tokens": 12,
        "forwards": 5,
        "tokens_per_forward": 2.4,
    }
    assert middleware.add_forwards({"usage": {"completion_tokens": 3}}) == {"usage": {"completion_tokens": 3}}


def _run_app(app_body, headers, request=b'{"messages": [], "tau": 0.9}'):
    """Drive MarsMiddleware around a fake app; returns (what the app received, what the client got)."""
    seen, sent = {}, []

    async def app(scope, receive, send):
        seen["body"] = (await receive())["body"]
        seen["headers"] = dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i, chunk in enumerate(app_body):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(app_body) - 1})

    async def receive():
        return {"type": "http.request", "body": request, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-length", str(len(request)).encode())],
    }
    asyncio.run(middleware.MarsMiddleware(app)(scope, receive, send))
    return seen, sent


def test_middleware_rewrites_json_and_event_streams():
    usage = {"usage": {"completion_tokens": 6}, "metrics": {"speculative_decoding": {"num_spec_steps": 4}}}
    body = json.dumps(usage).encode()
    seen, sent = _run_app(
        [body[:10], body[10:]], [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    )
    assert json.loads(seen["body"])["vllm_xargs"] == {"tau": 0.9}
    assert int(seen["headers"][b"content-length"]) == len(seen["body"])
    out = b"".join(m.get("body", b"") for m in sent)
    assert json.loads(out)["usage"]["tokens_per_forward"] == 1.5
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(out)).encode()

    stream = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\ndata: ' + body + b"\n\ndata: [DONE]\n\n"
    cut = stream.index(b'"usage"') + 3  # the usage event arrives in two pieces
    _, sent = _run_app([stream[:cut], stream[cut:]], [(b"content-type", b"text/event-stream")])
    events = b"".join(m.get("body", b"") for m in sent).split(b"\n\n")
    assert events[0] == b'data: {"choices": [{"delta": {"content": "a"}}]}' and events[2] == b"data: [DONE]"
    assert json.loads(events[1][len(b"data: ") :])["usage"]["forwards"] == 4


def test_middleware_refuses_with_an_openai_error():
    _, sent = _run_app([b"{}"], [(b"content-type", b"application/json")], request=b'{"tau": "high"}')
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"]) == {
        "error": {
            "message": "'tau' must be a number, got \"high\"",
            "type": "invalid_request_error",
            "param": "tau",
            "code": "invalid_type",  # as marslm serve answers it
        }
    }


def run_cli(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "marslm.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_serve_vllm_without_its_environment_fails_in_one_line(trained_dirs, tmp_path):
    proc = run_cli(
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(trained_dirs["dir"] / "mars"),
        MARSLM_VLLM_VENV=str(tmp_path / "none"),
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "make vllm-env" in proc.stderr
    proc = run_cli("loadtest", "--engine", "vllm", MARSLM_VLLM_VENV=str(tmp_path / "none"))
    assert proc.returncode == 2 and "--checkpoint" in proc.stderr


@pytest.fixture
def vllm_commands(tmp_path, monkeypatch):
    """The command lines ``marslm serve --engine vllm`` would run, in place of running them (a
    stand-in for vLLM's environment: only its Python's path is looked up)."""
    from marslm.vllm import launch as vllm_launch

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setenv("MARSLM_VLLM_VENV", str(tmp_path / "venv"))
    commands = []
    monkeypatch.setattr(vllm_launch, "exec_server", commands.append)
    return commands


def test_serve_vllm_serves_the_path_and_every_name(trained_dirs, vllm_commands):
    """As under marslm's engine: the directory's name (or --served-model-name's), then the path."""
    from marslm.cli import main

    commands = vllm_commands
    path = str(trained_dirs["dir"] / "mars")
    assert main(["serve", "--engine", "vllm", "--model", path]) == 0
    assert main(["serve", "--engine", "vllm", "--model", path, "--served-model-name", "a", "b"]) == 0

    def names(cmd):
        rest = cmd[cmd.index("--served-model-name") + 1 :]
        return rest[: next(i for i, arg in enumerate(rest + ["--"]) if arg.startswith("--"))]

    assert [names(cmd) for cmd in commands] == [["mars", path], ["a", "b", path]]


def test_plugin_needs_no_transformers():
    """What the plugin imports of marslm must work with the transformers vLLM pins: it imports none."""
    code = (
        "import sys; import marslm.vllm.request_settings, marslm.vllm.engine_args, marslm.vllm.middleware, "
        "marslm.vllm.exact, "
        "marslm.decode.acceptance; "
        "sys.exit('transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


class _Rows:
    """MarsRows as the proposer reads it, for three threshold rows with nothing pending."""

    mode = [THRESHOLD] * 3

    def refresh(self):
        return self

    def take_next_drafts(self):
        return None


def test_above_the_mask_batch_limit_no_row_drafts():
    from marslm.vllm.proposer import MarsProposer

    proposer = MarsProposer.__new__(MarsProposer)
    proposer.config = replace(MARS, mask_batch_limit=2)
    proposer.masks, proposer.rows = [3] * 4, _Rows()
    assert proposer.propose([[5], [6], [7]]) == [[], [], []]
    assert proposer.propose([[5], [6]]) == [[3] * 4, [3] * 4]
    proposer.config = MARS  # no limit: masks at every batch size
    assert proposer.propose([[5], [6], [7]]) == [[3] * 4] * 3


def test_the_mask_batch_limit_reaches_the_vllm_server_and_is_checked(trained_dirs, vllm_commands):
    from marslm.bench.loadtest import LoadtestConfig
    from marslm.cli import main
    from marslm.errors import UserError

    commands = vllm_commands
    path = str(trained_dirs["dir"] / "mars")
    assert main(["serve", "--engine", "vllm", "--model", path, "--mask-batch-limit", "8"]) == 0
    at = commands[0].index("--mask-batch-limit")
    assert commands[0][at + 1] == "8"
    for given in (["--mask-batch-limit", "auto"], []):  # auto, the default, is no limit under vLLM, said
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(["serve", "--engine", "vllm", "--model", path, *given]) == 0
        assert "--mask-batch-limit" not in commands[-1] and "without a mask batch limit" in err.getvalue()
    with pytest.raises(UserError, match="--mask-batch-limit must be an integer >= 1"):
        plugin_config(path, mask_batch_limit=0)
    assert plugin_config(path, mask_batch_limit=8).mask_batch_limit == 8
    with pytest.raises(UserError, match="--mask-batch-limit is for --engine vllm"):
        LoadtestConfig(mask_batch_limit=4)
    with pytest.raises(UserError, match="--mask-batch-limit must be an integer >= 1"):
        LoadtestConfig(engine="vllm", checkpoint=path, mask_batch_limit=0)
