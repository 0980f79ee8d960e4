"""Fixtures of the draft-model tests (test_draft_model.py, test_mars_drafter.py)."""

import pytest

from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.demo.toy_model import make_tiny_qwen2
from tests.decode.test_sampling import VOCAB
from tests.helpers import tiny_llama
from tests.trained import TRAIN_N


@pytest.fixture(scope="module")
def prompts(trained_checkpoints):
    _, tokenizer = trained_checkpoints["mars64"]
    examples = toy.make_split("train", TRAIN_N, seed=0)[::8][:4]  # memorised prompts: confident masks
    return [encode_prompt(tokenizer, ex.messages) for ex in examples]


@pytest.fixture(scope="module")
def bad_drafter(trained_checkpoints):
    _, tokenizer = trained_checkpoints["mars64"]
    return make_tiny_qwen2(tokenizer, "test", seed=3).double().eval()


@pytest.fixture(scope="module")
def other_vocab_model():
    return tiny_llama(VOCAB, hidden_size=16, num_hidden_layers=1, seed=9, head_scale=6.0)
