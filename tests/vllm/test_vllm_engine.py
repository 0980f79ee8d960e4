"""MARS inside vLLM, against oracles computed here (marslm's environment) on the toy-trained checkpoint.

vLLM runs in its own environment (``make vllm-env``): ``run_vllm.py`` there decodes, this side
compares. Without that environment these tests skip, unless ``MARSLM_REQUIRE_VLLM=1`` (CI),
where they fail.

Oracles:
  * vLLM's plain greedy and the MARS lossless mode equal transformers' greedy ``generate``.
  * Threshold mode equals ``marslm.generate`` (cache ``none``: every step recomputed from
    scratch, the same acceptance rule, B + 1 candidates) token for token. vLLM's first forward
    is a prefill, which never carries drafts, so it yields the one greedy token; the oracle
    decodes on from the prompt plus that token, and every later forward matches one of its
    steps, so the forward counts match too. Lossless mode matches marslm's lossless decoding
    the same way (same drafts, so same forwards).
  * Without the scheduler's rollback of accepted mask positions (the negative control), some
    answer differs from the oracle: the comparison can fail.
"""

import json

import pytest

from marslm.chat import encode_prompt
from marslm.data import toy
from tests.trained import TRAIN_N
from tests.vllm.harness import MAX_TOKENS, answer, check_against_marslm, marslm_oracle, run_job, vllm_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
SERVED_NAMES = ("mars-a", "mars-b")
LIMIT = 4  # the limited engine's --mask-batch-limit
MIXED = [
    {"tau": 0.95},
    {"tau": 0.8},
    {"mode": "lossless"},
    {"tau": 1.0},
    {"tau": 0.9, "metric": "margin"},
    {"tau": 0.5, "metric": "entropy"},
    {"tau": 0.6},
    {},
]


@pytest.fixture(scope="module")
def prompts(trained_checkpoints):
    _, tokenizer = trained_checkpoints["mars64"]
    examples = toy.make_split("train", TRAIN_N, seed=0)[::8]  # memorised: confident masks, ragged lengths
    return [encode_prompt(tokenizer, ex.messages) for ex in examples]


def _requests(prompts, settings):
    return [
        {"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "extra_args": s or None} for p, s in zip(prompts, settings)
    ]


@pytest.fixture(scope="module")
def decoded(vllm_env, trained_dirs, prompts, tmp_path_factory):
    n = len(prompts)
    job = {
        "model": str(trained_dirs["dir"] / "mars"),
        "max_model_len": MAX_MODEL_LEN,
        "engines": [
            {"name": "plain", "speculative": "none", "batches": {"greedy": _requests(prompts, [None] * n)}},
            {
                "name": "mars",
                "speculative": "mars",
                "batches": {
                    "lossless": _requests(prompts, [{"mode": "lossless"}] * n),
                    "tau0.95": _requests(prompts, [{"tau": 0.95}] * n),
                    "tau0.8": _requests(prompts, [{"tau": 0.8}] * n),
                    "mixed": _requests(prompts, [MIXED[i % len(MIXED)] for i in range(n)]),
                },
            },
            {
                "name": "limited",
                "speculative": "mars",
                "mask_batch_limit": LIMIT,
                "batches": {
                    "lossless": _requests(prompts, [{"mode": "lossless"}] * n),
                    "within": _requests(prompts[:LIMIT], [{"mode": "lossless"}] * LIMIT),
                },
            },
            {
                "name": "no_rollback",
                "speculative": "mars",
                "no_rollback": True,
                "batches": {"tau0.8": _requests(prompts, [{"tau": 0.8}] * n)},
            },
        ],
    }
    return run_job(vllm_env, job, tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="module")
def hf_greedy(trained_checkpoints, prompts):
    from tests.helpers import hf_greedy as reference

    model, tokenizer = trained_checkpoints["mars64"]
    return [reference(model, tokenizer, [p], MAX_TOKENS)[0] for p in prompts]


def test_plain_vllm_equals_hf_greedy(decoded, hf_greedy):
    assert [answer(o) for o in decoded["plain"]["greedy"]] == hf_greedy


def test_lossless_equals_greedy_in_fewer_forwards(decoded, trained_checkpoints, prompts, hf_greedy):
    lossless = decoded["mars"]["lossless"]
    assert [answer(o) for o in lossless] == hf_greedy
    assert sum(o["forwards"] for o in lossless) < sum(len(o["token_ids"]) for o in lossless)
    for prompt, output, greedy in zip(prompts, lossless, hf_greedy):
        check_against_marslm(trained_checkpoints["mars64"], prompt, output, {"mode": "lossless"}, greedy)


@pytest.mark.parametrize("tau", [0.95, 0.8])
def test_threshold_equals_marslm_generate(decoded, trained_checkpoints, prompts, hf_greedy, tau):
    outputs = decoded["mars"][f"tau{tau}"]
    for prompt, output, greedy in zip(prompts, outputs, hf_greedy):
        check_against_marslm(trained_checkpoints["mars64"], prompt, output, {"tau": tau}, greedy)
    assert sum(o["forwards"] for o in outputs) < sum(len(o["token_ids"]) for o in outputs)


def test_mixed_settings_share_a_batch(decoded, trained_checkpoints, prompts, hf_greedy):
    for i, (prompt, output, greedy) in enumerate(zip(prompts, decoded["mars"]["mixed"], hf_greedy)):
        settings = MIXED[i % len(MIXED)]
        if settings.get("tau") == 1.0:  # one-token mode: vLLM's own decoding
            assert answer(output) == greedy
            assert output["forwards"] == len(output["token_ids"])
        else:
            check_against_marslm(trained_checkpoints["mars64"], prompt, output, settings, greedy)


def test_above_the_mask_batch_limit_rows_decode_plainly(decoded, prompts, hf_greedy):
    """8 requests under a limit of 4 take plain steps while more than 4 decode (lossless, so the
    answers stay greedy); 4 requests read their masks as without a limit (a lossless row's forwards
    do not depend on the rows beside it)."""
    assert len(prompts) > LIMIT
    limited, free = decoded["limited"]["lossless"], decoded["mars"]["lossless"]
    assert [answer(o) for o in limited] == hf_greedy
    assert sum(o["forwards"] for o in limited) > sum(o["forwards"] for o in free)
    within = decoded["limited"]["within"]
    assert [answer(o) for o in within] == hf_greedy[:LIMIT]
    assert [o["forwards"] for o in within] == [o["forwards"] for o in free[:LIMIT]]


def test_negative_control_without_rollback_fails(decoded, trained_checkpoints, prompts, hf_greedy):
    """Accepted mask positions left with mask KV: some answer must leave the oracle."""
    differs = 0
    for prompt, output, greedy in zip(prompts, decoded["no_rollback"]["tau0.8"], hf_greedy):
        expected, _ = marslm_oracle(trained_checkpoints["mars64"], prompt, greedy[0], {"tau": 0.8})
        differs += answer(output) != expected
    assert differs > 0


# ------------------------------------------------------------------ the server, multiprocessing on
@pytest.fixture(scope="module")
def server(vllm_env, trained_dirs, tmp_path_factory):
    args = ("--served-model-name", *SERVED_NAMES, "--tau", "0.95")
    model = trained_dirs["dir"] / "mars"
    with vllm_server(
        model, tmp_path_factory.mktemp("server"), *args, vllm_args=("--max-model-len", str(MAX_MODEL_LEN))
    ) as url:
        yield url


def _chat(url, messages, **fields):
    import httpx

    return httpx.post(
        url + "/v1/chat/completions", json={"messages": messages, "max_tokens": MAX_TOKENS, **fields}, timeout=120
    )


def test_server_settings_streaming_and_usage(server, trained_checkpoints, decoded):
    import httpx

    _, tokenizer = trained_checkpoints["mars64"]
    examples = toy.make_split("train", TRAIN_N, seed=0)[::8]
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
    for i in (0, 1):
        offline = decoded["mars"]["tau0.8"][i]
        reply = _chat(server, examples[i].messages, model=model, tau=0.8)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"] == tokenizer.decode(answer(offline), skip_special_tokens=True)
        usage = body["usage"]
        assert usage["forwards"] == offline["forwards"]
        assert usage["tokens_per_forward"] == round(len(offline["token_ids"]) / offline["forwards"], 4)

    # streaming: the same text, and the usage chunk reports tokens per forward
    text, usage = [], None
    with httpx.stream(
        "POST",
        server + "/v1/chat/completions",
        timeout=120,
        json={
            "messages": examples[0].messages,
            "max_tokens": MAX_TOKENS,
            "tau": 0.8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    assert "".join(text) == tokenizer.decode(answer(decoded["mars"]["tau0.8"][0]), skip_special_tokens=True)
    assert usage["tokens_per_forward"] > 1


def test_server_answers_to_every_served_name_and_its_path(server, trained_dirs):
    import httpx

    path = str(trained_dirs["dir"] / "mars")
    assert [card["id"] for card in httpx.get(server + "/v1/models").json()["data"]] == [*SERVED_NAMES, path]
    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    for name in (SERVED_NAMES[1], path):
        reply = _chat(server, question, model=name)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == SERVED_NAMES[0]
    assert _chat(server, question, model="mars").status_code == 404  # the directory's name is not an alias here


def test_server_requests_with_different_settings_run_together(server, trained_checkpoints, decoded):
    from concurrent.futures import ThreadPoolExecutor

    _, tokenizer = trained_checkpoints["mars64"]
    examples = toy.make_split("train", TRAIN_N, seed=0)[::8]
    batches = ["lossless", "tau0.95", "tau0.8", "lossless"]
    fields = {"lossless": {"mode": "lossless"}, "tau0.95": {"tau": 0.95}, "tau0.8": {"tau": 0.8}}
    with ThreadPoolExecutor(len(batches)) as pool:
        replies = list(
            pool.map(lambda i: _chat(server, examples[i].messages, **fields[batches[i]]), range(len(batches)))
        )
    for i, reply in enumerate(replies):
        expected = tokenizer.decode(answer(decoded["mars"][batches[i]][i]), skip_special_tokens=True)
        assert reply.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tau": "high"}, "tau"),
        ({"tau": True}, "tau"),
        ({"tau": 1.5}, "tau"),
        ({"tau": 0}, "tau"),
        ({"metric": "certainty"}, "metric"),
        ({"mode": "fast"}, "mode"),
        ({"metric": "entropy"}, "tau"),
        ({"tau": 0.9, "temperature": 0.7}, "temperature"),
        ({"block_size": 2}, "block_size"),
        ({"vllm_xargs": {"tau": -1}}, "tau"),
    ],
)
def test_server_refuses_bad_values(server, fields, param):
    reply = _chat(server, [{"role": "user", "content": "What is 2 plus 3?"}], **fields)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
