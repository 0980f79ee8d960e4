"""The text a user gets is a function of the model, the inputs and the settings alone: no clock
decides it and nothing carried on the model or across calls moves it.

Default decoding (adaptive width, ``mask_batch_limit="auto"`` over a saved cost table in which
masks pay up to batch 4 while they buy enough, so the limit acts) at tau < 1: the same text twice in one
process, in two fresh processes, and with and without the cache; a seeded sample repeats across
processes; a server request at a fixed tau gets the same text alone and inside a 32-request
burst, where no load policy is switched on. The checkpoint is the toy-trained one in float64, so
batch shape cannot flip a near-tie.
"""

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from marslm import generate
from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.decode import costs
from marslm.modeling import load_model
from marslm.serve.config import ServeConfig
from marslm.serve.engine import Engine
from marslm.serve.requests import request_params

ROOT = Path(__file__).resolve().parents[1]
# tau 0.7: the tiny toy model's masks pass it often enough (at 0.9 it reads them and keeps few)
DEFAULT = dict(tau=0.7, max_new_tokens=40, batch_size=4)
# one process's decode, printed as JSON: (checkpoint, prompts, settings) -> token ids
SCRIPT = """
import json, sys
from marslm import generate, load
model, tokenizer = load(sys.argv[1], dtype="float64")
out = generate(model, tokenizer, json.loads(sys.argv[2]), **json.loads(sys.argv[3]))
print(json.dumps(out.token_ids))
"""


@pytest.fixture(scope="module")
def checkpoint(trained_dirs, tmp_path_factory) -> Path:
    """The MARS checkpoint, with a cost table by which masks pay up to batch 4 while they buy 1.3 tokens a row."""
    folder = tmp_path_factory.mktemp("costed") / "mars"
    shutil.copytree(trained_dirs["dir"] / "mars", folder)
    table = {"block_size": 4, "costs": {"1": 1.05, "2": 1.1, "4": 1.3, "8": 9.0}, "measured_on": {}}
    costs.save_cost_table(folder, table)
    return folder


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model, tokenizer, _ = load_model(str(checkpoint), dtype="float64")
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts():
    return [ex.messages for ex in toy.make_split("train", 12, seed=0)]


def in_a_fresh_process(checkpoint, prompts, **settings) -> list[list[int]]:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(checkpoint), json.dumps(prompts), json.dumps(settings)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("tau", [0.9, 0.7])
def test_default_decoding_is_the_same_twice_in_one_process_and_with_or_without_the_cache(loaded, prompts, tau):
    model, tokenizer = loaded
    settings = dict(DEFAULT, tau=tau)
    first = generate(model, tokenizer, prompts, **settings)
    assert first.stats.cost_table is not None  # the limit decided this decode's steps
    assert first.tokens_per_forward > 1.0
    second = generate(model, tokenizer, prompts, **settings)
    uncached = generate(model, tokenizer, prompts, cache="none", **settings)
    assert second.token_ids == first.token_ids
    assert uncached.token_ids == first.token_ids


def test_default_decoding_and_a_seeded_sample_repeat_across_processes(loaded, checkpoint, prompts):
    model, tokenizer = loaded
    here = generate(model, tokenizer, prompts, **DEFAULT).token_ids
    assert in_a_fresh_process(checkpoint, prompts, **DEFAULT) == here
    sampled = dict(DEFAULT, temperature=0.8, seed=7)
    first = in_a_fresh_process(checkpoint, prompts[:4], **sampled)
    assert in_a_fresh_process(checkpoint, prompts[:4], **sampled) == first
    assert first == generate(model, tokenizer, prompts[:4], **sampled).token_ids


def test_a_server_request_is_the_same_alone_and_inside_a_burst(loaded):
    """With the load policy off (the server's default, auto, makes it follow the load by design, and
    each answer names the limit), a request's text does not follow the batch it joins."""
    model, tokenizer = loaded
    examples = toy.make_split("train", 32, seed=0)
    ids = [encode_prompt(tokenizer, ex.messages) for ex in examples]
    params = request_params(tau=0.7, max_new_tokens=40)
    engine = Engine(model, tokenizer, ServeConfig(max_batch=32, mask_batch_limit=None))
    engine.start(warmup=False)
    try:

        async def texts(group):
            streams = [engine.submit(prompt, params) for prompt in group]
            for stream in streams:
                async for _ in stream:
                    pass
            return [stream.result.token_ids for stream in streams]

        alone = [asyncio.run(texts([prompt]))[0] for prompt in ids[:3]]
        burst = asyncio.run(texts(ids))
    finally:
        engine.stop()
    assert burst[:3] == alone
