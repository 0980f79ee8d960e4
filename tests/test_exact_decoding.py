"""An exact-mode checkpoint decodes as the original wherever the original's output is promised:
tau 1 and lossless give its greedy output token for token, through every cache mode and the
server; plain ``from_pretrained`` is the original itself.

The checkpoint is the toy-trained AR model with an exact-mode adapter trained on top
(tests/trained.py), so its masks are confident on the memorised prompts and the multi-token paths
run. Comparisons in float64, where batch shape cannot flip a near-tie.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from marslm import generate
from marslm.adapter import adapter_of
from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.decode import PAPER_RULE
from marslm.errors import UserError
from marslm.mars_json import MarsConfig
from tests.helpers import hf_greedy
from tests.trained import TRAIN_N


@pytest.fixture(scope="module")
def prompts(exact64):
    _, tokenizer = exact64
    return [encode_prompt(tokenizer, ex.messages) for ex in toy.make_split("train", TRAIN_N, seed=0)[::8]]


def test_the_checkpoint_is_the_original_plus_an_adapter(trained_dirs):
    root = trained_dirs["dir"]
    config = MarsConfig.load(root / "exact")
    assert config.exact and config.stage == "mars"
    for name in ("model.safetensors", "tokenizer.json"):
        digests = {hashlib.sha256((root / run / name).read_bytes()).hexdigest() for run in ("ar", "exact")}
        assert len(digests) == 1, f"{name} differs from the original's"
    assert (root / "exact" / "mars_adapter.safetensors").is_file()


def test_from_pretrained_alone_is_the_original(trained_dirs, original64, prompts):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(trained_dirs["dir"] / "exact", dtype=torch.float64).eval()
    model, tokenizer = original64
    assert adapter_of(plain) is None
    assert hf_greedy(plain, tokenizer, prompts[:3], 32) == hf_greedy(model, tokenizer, prompts[:3], 32)
    # marslm decodes it as what it is: the original, one token per forward
    out = generate(plain, tokenizer, prompts[:3], tau=1.0, max_new_tokens=32)
    assert out.token_ids == hf_greedy(model, tokenizer, prompts[:3], 32)
    with pytest.raises(UserError, match="mask token"):
        generate(plain, tokenizer, prompts[:1], tau=0.9, max_new_tokens=8)


@pytest.mark.parametrize("cache", ["none", "cursor", "block"])
@pytest.mark.parametrize("batch", [1, 8])
def test_tau_1_is_the_original_greedy(exact64, original64, prompts, cache, batch):
    expected = hf_greedy(*original64, prompts[:batch], 48)
    out = generate(*exact64, prompts[:batch], tau=1.0, cache=cache, max_new_tokens=48)
    assert out.token_ids == expected


@pytest.mark.parametrize("cache", ["none", "cursor"])
@pytest.mark.parametrize("draft_groups", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_lossless_is_the_original_greedy(exact64, original64, prompts, cache, draft_groups, batch):
    expected = hf_greedy(*original64, prompts[:batch], 48)
    settings = dict(mode="lossless", cache=cache, draft_groups=draft_groups, max_new_tokens=48, mask_batch_limit=None)
    out = generate(*exact64, prompts[:batch], **settings)
    assert out.token_ids == expected
    assert out.tokens_per_forward > 1.0  # the adapter's masks draft, and some drafts hold


def test_threshold_decoding_accepts_several_tokens(exact64, prompts):
    out = generate(*exact64, prompts, tau=0.6, max_new_tokens=48, **PAPER_RULE)
    assert max(max(steps) for steps in out.accepted_per_step) > 1


def test_the_server_engine_gives_the_original_greedy(exact64, original64, prompts):
    from marslm.serve.config import ServeConfig
    from marslm.serve.engine import Engine
    from marslm.serve.requests import request_params

    expected = hf_greedy(*original64, prompts[:4], 32)
    engine = Engine(*exact64, ServeConfig(max_batch=2))
    engine.start()
    try:

        async def main():
            streams = [
                engine.submit(
                    ids, request_params(tau=1.0, max_new_tokens=32, mode="lossless" if i % 2 else "threshold")
                )
                for i, ids in enumerate(prompts[:4])
            ]
            results = []
            for stream in streams:
                async for _ in stream:
                    pass
                results.append(stream.result.token_ids)
            return results

        assert asyncio.run(main()) == expected
    finally:
        engine.stop()
