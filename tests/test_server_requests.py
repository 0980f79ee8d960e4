"""Request fields of ``marslm serve`` in-process: the app over httpx's ASGI transport, the engine on
the toy-trained checkpoint (float64). What a field asks for is honoured, or refused with an OpenAI
error object; no request ever costs a traceback in the log."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from marslm import generate
from marslm.serve.config import ServeConfig
from marslm.serve.engine import Engine

pytest.importorskip("fastapi")

PROMPT = "Sort the list"


@pytest.fixture(scope="module")
def app(trained_checkpoints):
    from marslm.serve.app import create_app

    model, tokenizer = trained_checkpoints["mars64"]
    # no auto limit, here or in the offline references: under it, text at tau < 1 follows which
    # steps read masks, which it decides from this machine's timings and what it decoded before
    engine = Engine(model, tokenizer, ServeConfig(max_batch=4, mask_batch_limit=None))
    engine.start(warmup=False)
    try:
        yield create_app(engine, "toy")
    finally:
        engine.stop()


def post(app, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(app, "POST", path, content=content, headers={"Content-Type": "application/json"})


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def send():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(send())


@pytest.fixture
def serving(trained_checkpoints, trained_dirs):
    """``serving(ServeConfig)``: the app over a started engine for the toy checkpoint's directory,
    as ``marslm serve --model DIR`` makes it."""
    model, tokenizer = trained_checkpoints["mars64"]
    engines = []

    def make(config: ServeConfig):
        from marslm.serve.app import create_app

        engines.append(Engine(model, tokenizer, config))
        engines[-1].start(warmup=False)
        return create_app(engines[-1], str(trained_dirs["dir"] / "mars"))

    yield make
    for engine in engines:
        engine.stop()


def test_a_model_name_that_is_not_unicode_is_model_not_found(app, caplog):
    body = b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'  # a lone surrogate, as JSON escapes it
    with caplog.at_level(logging.WARNING):
        response = post(app, "/v1/completions", body)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "\\ud800" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_echo_puts_the_prompt_before_the_completion(app, trained_checkpoints):
    model, tokenizer = trained_checkpoints["mars64"]
    ref = generate(
        model, tokenizer, [PROMPT], tau=0.95, max_new_tokens=6, apply_chat_template=False, mask_batch_limit=None
    ).texts[0]
    body = {"prompt": PROMPT, "max_tokens": 6, "tau": 0.95}
    plain = post(app, "/v1/completions", body).json()["choices"][0]["text"]
    echoed = post(app, "/v1/completions", {**body, "echo": True}).json()["choices"][0]["text"]
    assert (plain, echoed) == (ref, PROMPT + ref)
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    from_ids = post(app, "/v1/completions", {**body, "prompt": ids, "echo": True}).json()["choices"][0]["text"]
    assert from_ids == tokenizer.decode(ids) + ref

    stream = post(app, "/v1/completions", {**body, "echo": True, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + ref


@pytest.mark.parametrize(
    "fields, param", [({"suffix": "!"}, "suffix"), ({"suffix": ""}, "suffix"), ({"echo": "yes"}, "echo")]
)
def test_completion_fields_it_cannot_honour_are_refused(app, fields, param):
    response = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path, prompt_field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_a_prompt_too_long_in_tokens_is_named_as_its_endpoint_took_it(app, path, prompt_field):
    text = "word " * 1100  # more tokens than the context holds, though few enough characters
    prompt = {"prompt": text} if prompt_field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    response = post(app, path, {**prompt, "max_tokens": 8})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "tokens" in error["message"] and "characters" not in error["message"]  # the engine's check
    assert (error["param"], error["code"]) == (prompt_field, "context_length_exceeded")


def test_an_admin_field_of_the_wrong_type_is_named(app):
    response = post(app, "/admin/policy", {"policy": 5})
    assert response.status_code == 400, response.text
    assert response.json()["error"] | {"message": None} == {
        "message": None,
        "type": "invalid_request_error",
        "param": "policy",
        "code": "invalid_type",
    }


def test_the_path_it_was_started_with_is_served_beside_the_directory_name(serving, trained_dirs):
    path = str(trained_dirs["dir"] / "mars")
    app = serving(ServeConfig(max_batch=2))
    assert [card["id"] for card in request(app, "GET", "/v1/models").json()["data"]] == ["mars", path]
    for name in ("mars", path):
        response = post(app, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "mars"  # answers carry the first name, as vLLM's do
    refused = post(app, "/v1/completions", {"model": "runs/other", "prompt": PROMPT, "max_tokens": 2})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    for name in ("mars", path):  # the openai client's models.retrieve(name)
        card = request(app, "GET", f"/v1/models/{name}")
        assert card.status_code == 200 and card.json()["id"] == name and card.json()["object"] == "model"
    unknown = request(app, "GET", "/v1/models/runs/other")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_served_model_names_are_all_served_and_replace_the_directory_name(serving, trained_dirs):
    from marslm.cli import build_parser
    from marslm.settings import from_args

    path = str(trained_dirs["dir"] / "mars")
    args = build_parser().parse_args(["serve", "--model", path, "--served-model-name", "a", "b"])
    config = from_args(ServeConfig, args, max_batch=2)
    assert (config.served_model_name, args.vllm_args) == (("a", "b"), [])
    app = serving(config)
    assert [card["id"] for card in request(app, "GET", "/v1/models").json()["data"]] == ["a", "b", path]
    for name, status in (("a", 200), ("b", 200), (path, 200), ("mars", 404)):
        response = post(
            app,
            "/v1/chat/completions",
            {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert response.status_code == status, (name, response.text)


def test_a_hybrid_request_decodes_as_generate_does_and_its_refusals_are_named(app, trained_checkpoints):
    model, tokenizer = trained_checkpoints["mars64"]
    for tau in (0.5, None):  # None: the server's default tau, which hybrid reads as threshold mode does
        expected = generate(
            model,
            tokenizer,
            [PROMPT],
            mode="hybrid",
            tau=ServeConfig().tau if tau is None else tau,
            max_new_tokens=12,
            apply_chat_template=False,
            mask_batch_limit=None,
        ).texts[0]
        body = {"prompt": PROMPT, "max_tokens": 12, "mode": "hybrid", **({} if tau is None else {"tau": tau})}
        response = post(app, "/v1/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
    for fields, param in [({"temperature": 0.7}, "temperature"), ({"metric": "entropy"}, "tau")]:
        response = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "mode": "hybrid", **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_a_body_becomes_the_decoding_params_it_names():
    from marslm.decode import DecodingParams
    from marslm.serve.openai import parse_options

    params, stream, include_usage = parse_options(
        {"tau": 0.8, "max_completion_tokens": 7, "mode": "lossless", "top_k": 3, "stop": ["x", ""], "stream": True},
        chat=True,
    )
    assert params == DecodingParams(tau=0.8, max_new_tokens=7, mode="lossless", top_k=3, stop=("x",))
    assert (stream, include_usage) == (True, False)
    # a field it names not: DecodingParams' default, but tau and max_tokens are the server's (None)
    params = parse_options({"max_tokens": 5}, chat=False)[0]
    assert params == DecodingParams(tau=None, max_new_tokens=5)
