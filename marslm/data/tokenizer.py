"""A small byte-level BPE chat tokenizer, trained from scratch.

No model hub is reachable, so the embedded default model needs a tokenizer we
can build locally in seconds. It is a genuine ``Qwen2Tokenizer`` with a small
learned vocabulary, so downstream code cannot tell it from a Qwen2.5 one:

* byte-level BPE with Qwen2's own normalizer (NFC) and pre-tokenizer, so every
  NFC string round-trips exactly and each digit is its own token;
* ChatML special tokens, with ``<|im_end|>`` as EOS and ``<|endoftext|>`` as PAD;
* the chat template travels inside the saved tokenizer, so
  ``AutoTokenizer.from_pretrained(dir).apply_chat_template(...)`` works with no
  custom code.

The special tokens take ids 0..3, before any learned merge, so their ids do not
depend on the training texts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)

# Qwen2.5's ChatML layout, minus the default system prompt that Qwen injects
# when none is given: on a tiny model every token of context is expensive, and
# a constant preamble teaches it nothing.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def _untrained_qwen2_backend() -> Tokenizer:
    """An empty BPE with exactly the normalizer, pre-tokenizer and decoder of Qwen2Tokenizer.

    The merges must be learned under the same text splitting that will apply
    them. We borrow the pipeline from transformers rather than restating it,
    because for a directory whose config.json says model_type "qwen2",
    AutoTokenizer always instantiates Qwen2Tokenizer (whatever
    tokenizer_config.json declares), and that class rebuilds this pipeline from
    its own recipe, keeping only our vocab and merges.

    Qwen2's split regex isolates every digit (a lone ``\\p{N}``), which keeps
    place value visible: "123" and "1234" share structure a tiny model can
    learn arithmetic from.
    """
    reference = Qwen2Tokenizer().backend_tokenizer
    backend = Tokenizer(models.BPE())
    backend.normalizer = reference.normalizer
    backend.pre_tokenizer = reference.pre_tokenizer
    backend.decoder = reference.decoder
    return backend


def train_chat_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 1024,
    min_frequency: int = 2,
    *,
    split_digits: bool = True,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a ``Qwen2Tokenizer``.

    ``vocab_size`` counts the 4 special tokens and the 256 byte symbols, so it
    must be at least 260; the result can be smaller if the texts run out of
    merges above ``min_frequency``. Training is deterministic: the same texts
    give the same vocabulary.

    ``split_digits`` exists only to make the choice explicit: digits are split
    by Qwen2's pre-tokenizer, which transformers re-imposes on every load, so
    merged digits could not survive a save/load round trip.
    """
    _check_arguments(vocab_size, split_digits)
    learned = _learn_bpe(texts, vocab_size, min_frequency)
    return _as_qwen2_tokenizer(learned, model_max_length)


def _check_arguments(vocab_size: int, split_digits: bool) -> None:
    if not split_digits:
        raise ValueError(
            "split_digits=False is not supported: Qwen2's pre-tokenizer, which transformers "
            "re-imposes when loading, always splits digits"
        )
    base = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < base:
        raise ValueError(f"vocab_size must be at least {base} (specials + byte alphabet), got {vocab_size}")


def _learn_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int) -> dict:
    """The learned BPE model (its ``vocab`` and ``merges``), under Qwen2's text splitting."""
    backend = _untrained_qwen2_backend()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        # Listed first, so they get ids 0..3 in this order.
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet, even bytes absent from the corpus, so any
        # string can be encoded without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return json.loads(backend.to_str())["model"]


def _as_qwen2_tokenizer(learned: dict, model_max_length: int) -> PreTrainedTokenizerFast:
    """A ``Qwen2Tokenizer`` of the learned vocabulary and merges, with the ChatML specials at ids 0..3."""
    tokenizer = Qwen2Tokenizer(
        vocab=learned["vocab"],
        merges=[tuple(merge) for merge in learned["merges"]],
        # Explicit None rather than Qwen2Tokenizer's defaults: saved as null in
        # tokenizer_config.json, so reloading cannot bring the defaults back
        # (which would make <|endoftext|> the unk and eos token).
        bos_token=None,
        unk_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        # mask_token gives the usual `tokenizer.mask_token_id` handle; listing
        # the ChatML markers as extra specials matches how Qwen2.5 ships them,
        # and makes decode(skip_special_tokens=True) drop all four.
        mask_token=MASK,
        extra_special_tokens=[IM_START, IM_END, MASK],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        # Cleanup rewrites " ." to "." and the like, which breaks exact round trips.
        clean_up_tokenization_spaces=False,
    )
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.convert_tokens_to_ids(token) != index:
            raise AssertionError(f"special token {token} got id {tokenizer.convert_tokens_to_ids(token)}, not {index}")
    return tokenizer
