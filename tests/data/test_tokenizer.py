"""The embedded tokenizer and tiny model must behave like a hub checkpoint.

Everything here goes through the plain transformers Auto* entry points, since
that is how the rest of marslm (and any user) will load them.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from marslm.data.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_chat_tokenizer
from marslm.demo.toy_model import MODEL_SIZES, TinyModelSpec, make_tiny_qwen2
from marslm.modeling import count_parameters

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "héllo wörld, naïve café — “quotes” 🚀 日本語のテキスト",
    "12 + 345 = 357\n3.14159 * 2 = 6.28318",
    "def f(x):\n    if x:\n\treturn  x  \n\n\n    # trailing spaces   ",
    "  leading spaces and a trailing newline\n",
    "it's, don't, I'LL, we've",
    "",
]


def _corpus(n: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "sum", "of", "and", "is", "what", "list", "sort", "reverse", "answer", "please", "number"]
    texts = []
    for _ in range(n):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        texts.append(f"{sentence.capitalize()}: {rng.randint(0, 9999)} + {rng.randint(0, 999)} = ?\n")
    return texts


@pytest.fixture(scope="module")
def tokenizer():
    return train_chat_tokenizer(_corpus(), vocab_size=512)


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """Tokenizer saved beside a model, as in every checkpoint directory."""
    path = tmp_path_factory.mktemp("model")
    make_tiny_qwen2(tokenizer, "test", seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------- tokenizer


def test_special_token_ids(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.bos_token is None and tokenizer.unk_token is None
    assert tokenizer.mask_token_id == 3
    assert "<|mask|>" in tokenizer.extra_special_tokens
    assert set(tokenizer.all_special_ids) == {0, 1, 2, 3}


def test_mask_is_one_special_token(tokenizer):
    ids = tokenizer.encode("a<|mask|><|mask|>b", add_special_tokens=False)
    assert ids.count(3) == 2
    assert tokenizer.convert_ids_to_tokens(3) == "<|mask|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_skip_special_tokens_drops_all_four(tokenizer):
    text = "<|im_start|>assistant\nfine<|mask|><|im_end|><|endoftext|>"
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == "assistant\nfine"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_vocab_size_and_merges(tokenizer):
    # The small corpus runs out of merges seen twice before reaching 512.
    assert 260 < len(tokenizer) <= 512
    # Merges were learned: frequent corpus words are single tokens.
    assert len(tokenizer.encode(" answer")) == 1


def test_digits_are_single_tokens(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("9999 12345"))
    assert tokens == ["9", "9", "9", "9", "Ġ", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_encode_round_trip(tokenizer, text):
    # Nothing is unknown: byte-level BPE covers every byte, learned or not.
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_no_bos_or_eos_added(tokenizer):
    assert tokenizer("hi").input_ids == tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_text(tokenizer):
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_chat_template_ids(tokenizer):
    # transformers 5 returns a BatchEncoding from tokenize=True unless return_dict=False.
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    assert ids == tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert ids[-1] == tokenizer.encode("\n")[0]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


@pytest.mark.parametrize("where", ["tokenizer_dir", "model_dir"])
def test_save_load_round_trip(tokenizer, where, request):
    # Beside a Qwen2 config.json, AutoTokenizer picks Qwen2Tokenizer whatever
    # tokenizer_config.json says; both directories must load the same tokenizer.
    loaded = AutoTokenizer.from_pretrained(request.getfixturevalue(where))
    assert type(loaded) is type(tokenizer)
    assert len(loaded) == len(tokenizer)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    for text in ROUND_TRIP_TEXTS + _corpus(50, seed=1) + ["x<|mask|>y<|im_end|>"]:
        assert loaded.encode(text) == tokenizer.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert [loaded.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id, loaded.mask_token_id) == (2, 0, None, 3)
    assert loaded.unk_token_id is None
    assert set(loaded.all_special_ids) == {0, 1, 2, 3}
    assert loaded.model_max_length == tokenizer.model_max_length
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )


def test_training_is_deterministic():
    texts = _corpus(500, seed=3)
    first = train_chat_tokenizer(texts, vocab_size=400)
    second = train_chat_tokenizer(list(texts), vocab_size=400)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_bad_arguments():
    with pytest.raises(ValueError):
        train_chat_tokenizer(["abc"], vocab_size=100)
    with pytest.raises(ValueError):
        train_chat_tokenizer(["abc"], split_digits=False)


# ---------------------------------------------------------------- tiny model


def test_config_vocab_is_padded(tokenizer):
    small = train_chat_tokenizer(_corpus(200), vocab_size=300)
    for tok in (tokenizer, small):
        config = make_tiny_qwen2(tok, "test").config
        assert config.vocab_size >= len(tok)
        assert config.vocab_size % 64 == 0
        assert config.vocab_size - len(tok) < 64
    assert make_tiny_qwen2(small, "test").config.vocab_size > len(small)


def test_config_matches_tokenizer(tokenizer):
    model = make_tiny_qwen2(tokenizer, "test")
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.bos_token_id is None
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.do_sample is False


def test_forward(tokenizer):
    model = make_tiny_qwen2(tokenizer, "test")
    ids = torch.tensor([tokenizer.encode("hello world 12")])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.loss)


def test_seeded_init(tokenizer):
    a = make_tiny_qwen2(tokenizer, "test", seed=0).state_dict()
    b = make_tiny_qwen2(tokenizer, "test", seed=0).state_dict()
    c = make_tiny_qwen2(tokenizer, "test", seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_global_rng_untouched(tokenizer):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_qwen2(tokenizer, "test", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_save_load_generate(tokenizer, model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    fresh = make_tiny_qwen2(tokenizer, "test", seed=0)
    reference = fresh.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())

    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=5)
        second = model.generate(**inputs, max_new_tokens=5)
        from_fresh = fresh.generate(inputs["input_ids"], max_new_tokens=5)
    assert first.shape[1] <= inputs["input_ids"].shape[1] + 5
    assert torch.equal(first, second)
    assert torch.equal(first, from_fresh)

    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["pad_token_id"] == 0


def test_generate_stops_at_im_end(tokenizer):
    model = make_tiny_qwen2(tokenizer, "test")
    # Force <|im_end|> to win every step: generation must stop after one token.
    eos = torch.tensor([tokenizer.eos_token_id])
    model.lm_head.register_forward_hook(lambda module, args, logits: logits.index_fill(-1, eos, 1e4))
    ids = torch.tensor([tokenizer.encode("hello")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5)
    assert out[0, ids.shape[1] :].tolist() == [tokenizer.eos_token_id]


def test_model_sizes_and_param_counts(tokenizer):
    assert set(MODEL_SIZES) == {"test", "quick"}
    assert count_parameters(make_tiny_qwen2(tokenizer, "test")) < 300_000
    assert 1_000_000 <= count_parameters(make_tiny_qwen2(tokenizer, "quick")) <= 2_000_000


def test_count_parameters_counts_tied_weights_once(tokenizer):
    spec = MODEL_SIZES["test"]
    tied = make_tiny_qwen2(tokenizer, spec)
    untied = make_tiny_qwen2(tokenizer, TinyModelSpec(**{**vars(spec), "tie_word_embeddings": False}))
    embedding = tied.config.vocab_size * spec.hidden_size
    assert count_parameters(untied) - count_parameters(tied) == embedding
    assert count_parameters(tied) == sum(p.numel() for p in tied.parameters())


def test_unknown_preset(tokenizer):
    with pytest.raises(ValueError, match="unknown model size"):
        make_tiny_qwen2(tokenizer, "huge")
