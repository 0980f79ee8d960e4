"""The serving engine with a separate drafter (``marslm serve --draft-model``, serve/drafting.py):
one request at a time through the engine's own turn, equal to ``generate(..., draft_model=...)``,
streamed step by step, cancellable, refused in one line where it cannot run.

Float64 toy-trained checkpoints (tests/trained.py): the MARS model is the target, its AR parent
the drafter.
"""

import asyncio
import json

import httpx
import pytest

from marslm import generate
from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.decode import PAPER_RULE, ParamError
from marslm.decode.draft_options import DraftOptions
from marslm.errors import UserError
from marslm.serve.config import ServeConfig
from marslm.serve.engine import Engine
from marslm.serve.requests import request_params
from tests.cli.test_errors import assert_one_line_error, run
from tests.helpers import hf_greedy, tiny_llama
from tests.trained import TRAIN_N, find_long_prompt

K = 3


@pytest.fixture(scope="module")
def pair(trained_checkpoints):
    return trained_checkpoints["mars64"], trained_checkpoints["ar64"][0]


@pytest.fixture(scope="module")
def long_prompt(pair):
    _, tokenizer = pair[0]
    return encode_prompt(tokenizer, find_long_prompt(*pair[0]), apply_chat_template=False)


def drafted_engine(pair, start: bool = True, **config) -> Engine:
    (model, tokenizer), draft = pair
    engine = Engine(model, tokenizer, ServeConfig(**config), drafting=dict(draft_model=draft, num_draft_tokens=K))
    if start:
        engine.start(warmup=False)
    return engine


def drafted_generate(pair, prompt_ids, **settings):
    (model, tokenizer), draft = pair
    return generate(model, tokenizer, [prompt_ids], draft_model=draft, num_draft_tokens=K, **settings)


async def _drain(stream):
    chunks = [ids async for ids in stream]
    return chunks, stream.result


SETTINGS = [
    dict(tau=1.0, max_new_tokens=60),
    dict(tau=0.6, max_new_tokens=120),
    dict(tau=0.8, temperature=0.8, seed=5, max_new_tokens=40),
    dict(max_new_tokens=50),  # the server's default tau
]


def per_step_chunks(result) -> list[int]:
    """The chunk sizes a stream of one chunk per step delivers: each step's accepted tokens, the
    stop token that ends the last step not among them."""
    sizes = list(result.accepted_per_step)
    if result.finish_reason == "stop":
        sizes[-1] -= 1
    return [n for n in sizes if n]


def test_drafted_requests_equal_generate_with_the_drafter(pair):
    (model, tokenizer), _ = pair
    prompts = [encode_prompt(tokenizer, ex.messages) for ex in toy.make_split("train", TRAIN_N, seed=0)[::9][:5]]
    refs = [drafted_generate(pair, p, **{"tau": 0.9, **s}) for p, s in zip(prompts, SETTINGS)]
    text = drafted_generate(pair, prompts[4], tau=0.9, max_new_tokens=60).texts[0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    engine = drafted_engine(pair, tau=0.9)
    try:

        async def main():  # all at once: they queue, and decode one after another
            streams = [engine.submit(p, request_params(**s)) for p, s in zip(prompts, SETTINGS)]
            streams.append(engine.submit(prompts[4], request_params(max_new_tokens=60, stop=(stop,))))
            return await asyncio.gather(*(_drain(s) for s in streams))

        outcomes = asyncio.run(main())
        snap = engine.snapshot()
    finally:
        engine.stop()
    for prompt, setting, ref, (chunks, result) in zip(prompts, SETTINGS, refs, outcomes):
        assert result.token_ids == ref.token_ids[0], setting
        assert result.accepted_per_step == ref.accepted_per_step[0]
        assert [t for c in chunks for t in c] == result.token_ids
        assert [len(c) for c in chunks] == per_step_chunks(result)
        if setting.get("tau") == 1.0:  # plain speculative decoding: the target's greedy answer
            assert result.token_ids == hf_greedy(model, tokenizer, [prompt], setting["max_new_tokens"])[0]
    assert max(outcomes[1][1].accepted_per_step) > K + 1  # tau 0.6: masks after the kept drafts
    stopped = outcomes[-1][1]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    assert snap["max_batch"] == 1 and snap["requests"]["finished"] == len(outcomes)
    assert snap["drafter"]["model"] and snap["drafter"]["num_draft_tokens"] == K
    assert snap["drafter"]["draft_tau"] is None  # an AR drafter: no tau of its own


def test_cancel_mid_request_then_the_queue_goes_on(pair, long_prompt):
    engine = drafted_engine(pair)
    try:

        async def main():
            running = engine.submit(long_prompt, request_params(max_new_tokens=300, tau=1.0))
            queued = engine.submit(long_prompt, request_params(max_new_tokens=30, tau=0.6))
            first = await running.__aiter__().__anext__()
            engine.cancel(running.request_id)
            return first, (await _drain(running))[1], (await _drain(queued))[1]

        first, cancelled, after = asyncio.run(main())
        snap = engine.snapshot()
    finally:
        engine.stop()
    assert first and cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 300
    assert after.token_ids == drafted_generate(pair, long_prompt, tau=0.6, max_new_tokens=30).token_ids[0]
    assert snap["requests"]["cancelled"] == 1 and snap["active_batch"] == 0


def test_a_running_request_follows_the_default_tau(pair, long_prompt):
    engine = drafted_engine(pair, tau=1.0)
    try:

        async def main():
            stream = engine.submit(long_prompt, request_params(max_new_tokens=300))
            await stream.__aiter__().__anext__()
            engine.set_policy(tau=0.3)  # from the running row's next step on
            return (await _drain(stream))[1]

        result = asyncio.run(main())
    finally:
        engine.stop()
    assert result.tau == 0.3 and result.accepted_per_step[0] <= K + 1
    assert max(result.accepted_per_step) > K + 1  # masks read after the change


def test_a_request_without_a_seed_draws_from_the_server_seed(pair, long_prompt):
    sampled = dict(tau=0.8, temperature=1.5, max_new_tokens=30)
    expected = drafted_generate(pair, long_prompt, seed=7, **sampled).token_ids[0]
    assert drafted_generate(pair, long_prompt, seed=8, **sampled).token_ids[0] != expected
    engine = drafted_engine(pair, seed=7)
    try:

        async def main():
            return (await _drain(engine.submit(long_prompt, request_params(**sampled))))[1]

        result = asyncio.run(main())
    finally:
        engine.stop()
    assert result.token_ids == expected


@pytest.mark.parametrize("mode", ["lossless", "hybrid"])
def test_a_request_in_another_mode_is_refused(pair, mode):
    engine = drafted_engine(pair, start=False)
    with pytest.raises(ParamError, match="^a draft model decodes in threshold mode with the cursor cache$") as err:
        engine.resolve([5] * 10, request_params(mode=mode))
    assert err.value.param == "mode"
    assert engine.resolve([5] * 10, request_params(stop=("x",))).stop == ("x",)  # the engine matches stop strings


def test_bad_combinations_are_refused_in_one_line(pair):
    (model, tokenizer), draft = pair
    with pytest.raises(UserError, match="--mask-batch-limit limits masks by batch size; with --draft-model"):
        drafted_engine(pair, start=False, mask_batch_limit=2)
    for rule in ({}, PAPER_RULE):  # the default fallback does not apply to drafted steps, and is not refused
        ServeConfig(drafting=DraftOptions(draft_model="drafter"), **rule)
    other = tiny_llama(7, hidden_size=16, num_hidden_layers=1, seed=9)
    with pytest.raises(UserError, match="the draft model's vocabulary"):
        Engine(model, tokenizer, ServeConfig(), drafting=dict(draft_model=other, num_draft_tokens=K))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--draft-tau", "0.9"], "--draft-tau needs --draft-model"),
        (["--draft-model", "{ar}", "--num-draft-tokens", "0"], "--num-draft-tokens must be in 1..16, got 0"),
        (["--draft-model", "{ar}", "--mask-batch-limit", "2"], "--mask-batch-limit limits masks by batch size"),
        (["--draft-model", "{ar}", "--engine", "vllm"], "--draft-model is marslm's engine; with vLLM, its own"),
    ],
)
def test_the_cli_refuses_before_loading(trained_dirs, capsys, monkeypatch, flags, fragment):
    from marslm import modeling

    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    ar = str(trained_dirs["dir"] / "ar")
    rc, _, err = run(capsys, "serve", "--model", trained_dirs["dir"] / "mars", *[f.replace("{ar}", ar) for f in flags])
    assert_one_line_error(rc, err, fragment)


def test_the_app_names_the_drafter_and_streams_its_steps(pair):
    from marslm.serve.app import create_app

    (model, tokenizer), _ = pair
    engine = drafted_engine(pair)
    app = create_app(engine, "toy")
    body = {"prompt": "Sort the list", "max_tokens": 24, "tau": 1.0}

    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            card = (await client.get("/v1/models")).json()["data"][0]
            whole = (await client.post("/v1/completions", json=body)).json()
            streamed = await client.post("/v1/completions", json={**body, "stream": True})
            return card, whole, streamed.text, (await client.get("/metrics")).text

    try:
        card, whole, events, metrics = asyncio.run(send())
    finally:
        engine.stop()
    assert card["drafter"]["num_draft_tokens"] == K
    assert 'marslm_drafter_info{model="' in metrics
    prompt = encode_prompt(tokenizer, "Sort the list", apply_chat_template=False)
    ref = drafted_generate(pair, prompt, tau=1.0, max_new_tokens=24)
    assert whole["choices"][0]["text"] == ref.texts[0]
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    pieces = [c["choices"][0]["text"] for c in chunks if c.get("choices") and c["choices"][0]["text"]]
    assert "".join(pieces) == ref.texts[0] and len(pieces) > 1
