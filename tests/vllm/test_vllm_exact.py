"""An exact checkpoint served by vLLM (exact.py, exact_runner.py), against oracles computed here on
the toy-trained exact checkpoint.

Oracles:
  * vLLM's plain greedy, MARS lossless and tau 1 equal transformers' greedy ``generate`` of the
    original model (the exact checkpoint's parent, float64): the adapter reaches no clean token.
  * Threshold and lossless modes equal ``marslm.generate`` on the exact checkpoint token for token
    and forward for forward (as test_vllm_engine.py checks a full checkpoint).
  * The negative control maps the adapter per request, as vLLM would on its own: every token of a
    MARS request then reads it, and some answer leaves the original's. The comparison can fail.
"""

import json
import os
from pathlib import Path

import pytest

from marslm.chat import encode_prompt
from marslm.data import toy
from tests.trained import TRAIN_N
from tests.vllm.harness import MAX_TOKENS, answer, check_against_marslm, run_job, vllm_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
SETTINGS = {"lossless": {"mode": "lossless"}, "tau1": {"tau": 1.0}, "tau0.95": {"tau": 0.95}, "tau0.8": {"tau": 0.8}}
MIXED = [{"tau": 0.8}, {"mode": "lossless"}, {"tau": 1.0}, {"tau": 0.6, "metric": "margin"}]


@pytest.fixture(scope="module")
def examples():
    return toy.make_split("train", TRAIN_N, seed=0)[::8]  # memorised: confident masks, ragged lengths


@pytest.fixture(scope="module")
def prompts(exact64, examples):
    _, tokenizer = exact64
    return [encode_prompt(tokenizer, ex.messages) for ex in examples]


def _requests(prompts, settings, **extra):
    return [
        {"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "extra_args": s, **extra} for p, s in zip(prompts, settings)
    ]


@pytest.fixture(scope="module")
def decoded(vllm_env, trained_dirs, prompts, tmp_path_factory):
    n = len(prompts)
    batches = {name: _requests(prompts, [settings] * n) for name, settings in SETTINGS.items()}
    job = {
        "model": str(trained_dirs["dir"] / "exact"),
        "max_model_len": MAX_MODEL_LEN,
        "engines": [
            {"name": "plain", "speculative": "none", "batches": {"greedy": _requests(prompts, [None] * n)}},
            {
                "name": "exact",
                "speculative": "mars",
                "batches": {
                    **batches,
                    "mixed": _requests(prompts, [MIXED[i % len(MIXED)] for i in range(n)]),
                    "own_lora": _requests(prompts[:2], [None] * 2, own_lora=True),
                },
            },
            {"name": "ungated", "speculative": "mars", "ungated": True, "batches": {"tau0.8": batches["tau0.8"]}},
        ],
    }
    return run_job(vllm_env, job, tmp_path_factory.mktemp("vllm-exact"))


@pytest.fixture(scope="module")
def original_greedy(original64, prompts):
    from tests.helpers import hf_greedy

    model, tokenizer = original64
    return [hf_greedy(model, tokenizer, [p], MAX_TOKENS)[0] for p in prompts]


def test_served_plainly_the_exact_checkpoint_is_the_original(decoded, original_greedy):
    assert [answer(o) for o in decoded["plain"]["greedy"]] == original_greedy


@pytest.mark.parametrize("batch", ["lossless", "tau1"])
def test_lossless_and_tau_1_answer_as_the_original_does(decoded, original_greedy, batch):
    outputs = decoded["exact"][batch]
    assert [answer(o) for o in outputs] == original_greedy
    tokens, forwards = sum(len(o["token_ids"]) for o in outputs), sum(o["forwards"] for o in outputs)
    assert forwards < tokens if batch == "lossless" else forwards == tokens


@pytest.mark.parametrize("batch", ["lossless", "tau0.95", "tau0.8"])
def test_exact_decoding_equals_marslm_generate(decoded, exact64, prompts, original_greedy, batch):
    for prompt, output, greedy in zip(prompts, decoded["exact"][batch], original_greedy):
        check_against_marslm(exact64, prompt, output, SETTINGS[batch], greedy)
    if batch != "tau0.95":  # the toy's adapter is rarely that sure
        outputs = decoded["exact"][batch]
        assert sum(o["forwards"] for o in outputs) < sum(len(o["token_ids"]) for o in outputs)


def test_mixed_settings_share_a_batch(decoded, exact64, prompts, original_greedy):
    for i, (prompt, output, greedy) in enumerate(zip(prompts, decoded["exact"]["mixed"], original_greedy)):
        check_against_marslm(exact64, prompt, output, MIXED[i % len(MIXED)], greedy)


def test_negative_control_the_adapter_on_every_token_changes_answers(decoded, original_greedy):
    ungated = [answer(o) for o in decoded["ungated"]["tau0.8"]]
    assert sum(a != g for a, g in zip(ungated, original_greedy)) > 0


def test_a_request_with_a_lora_of_its_own_is_refused(decoded):
    assert "cannot bring a LoRA of its own" in decoded["exact"]["own_lora"]["error"]


@pytest.fixture(scope="module")
def server(vllm_env, trained_dirs, tmp_path_factory):
    limits = ("--max-model-len", str(MAX_MODEL_LEN))
    with vllm_server(trained_dirs["dir"] / "exact", tmp_path_factory.mktemp("server"), vllm_args=limits) as url:
        yield url


def test_the_openai_client_gets_the_originals_answers(server, decoded, exact64, examples, original_greedy):
    """Through the official client: tau 1 and lossless answer the original's text, tau 0.8 in fewer
    forwards than tokens, and a bad tau is a 400."""
    import openai

    _, tokenizer = exact64
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    fewer = 0
    for example, greedy, offline in zip(examples, original_greedy, decoded["exact"]["tau0.8"]):
        text = tokenizer.decode(greedy, skip_special_tokens=True)
        for fields in ({"tau": 1.0}, {"mode": "lossless"}):
            reply = client.chat.completions.create(
                model=model, messages=example.messages, max_tokens=MAX_TOKENS, extra_body=fields
            )
            assert reply.choices[0].message.content == text
        reply = client.chat.completions.create(
            model=model, messages=example.messages, max_tokens=MAX_TOKENS, extra_body={"tau": 0.8}
        )
        assert reply.choices[0].message.content == tokenizer.decode(answer(offline), skip_special_tokens=True)
        usage = reply.usage.model_extra
        assert usage["forwards"] == offline["forwards"]
        fewer += usage["tokens_per_forward"] > 1
    assert fewer > 0
    with pytest.raises(openai.BadRequestError, match="tau"):
        client.chat.completions.create(
            model=model, messages=examples[0].messages, max_tokens=4, extra_body={"tau": 1.5}
        )


REAL = os.environ.get("MARSLM_EXACT_CHECKPOINT")  # e.g. runs/sm2/mars, the smollm2 preset's


@pytest.mark.skipif(not REAL, reason="set MARSLM_EXACT_CHECKPOINT to an exact checkpoint directory")
def test_a_real_exact_checkpoint_answers_as_its_original(vllm_env, tmp_path):
    """The same checks on a real exact checkpoint, through the official client: tau 1 and lossless
    give the text of transformers' greedy ``generate`` on its weights (float32, the original's),
    and tau 0.95 is served, reporting its tokens per forward."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import hf_greedy

    tokenizer = AutoTokenizer.from_pretrained(REAL)
    original = AutoModelForCausalLM.from_pretrained(REAL, dtype=torch.float32).eval()
    examples = toy.make_split("test", 16, seed=0)
    greedy = [hf_greedy(original, tokenizer, [encode_prompt(tokenizer, ex.messages)], 64)[0] for ex in examples]
    report = {}
    with vllm_server(Path(REAL), tmp_path, vllm_args=("--max-model-len", "1024")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        for name, fields in {"tau1": {"tau": 1.0}, "lossless": {"mode": "lossless"}, "tau0.95": {"tau": 0.95}}.items():
            replies = [
                client.chat.completions.create(model=model, messages=ex.messages, max_tokens=64, extra_body=fields)
                for ex in examples
            ]
            texts = [r.choices[0].message.content for r in replies]
            same = sum(t == tokenizer.decode(g, skip_special_tokens=True) for t, g in zip(texts, greedy))
            tokens = sum(r.usage.completion_tokens for r in replies)
            forwards = sum(r.usage.model_extra["forwards"] for r in replies)
            report[name] = {"same_as_original": same, "answers": len(texts), "tokens_per_forward": tokens / forwards}
    print(json.dumps(report))
    assert report["tau1"]["same_as_original"] == report["lossless"]["same_as_original"] == len(examples)
    assert report["tau0.95"]["tokens_per_forward"] > 1
