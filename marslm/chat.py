"""Chat formatting, in one place: training examples and decoding prompts go through here.

Both use the tokenizer's own chat template, so a checkpoint is trained on exactly the text it
will be prompted with. Loss goes on assistant turns only. Templates rarely mark assistant spans
(``{% generation %}``), so we find them by rendering growing prefixes of the conversation and
mapping the character spans onto tokens with the offset mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UserError
from .mars_json import MASK_TOKEN

IGNORE = -100


@dataclass
class EncodedChat:
    input_ids: list[int]
    labels: list[int]  # IGNORE outside assistant turns
    truncated: bool = False


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Every id that ends an assistant turn: the tokenizer's EOS and the generation config's."""
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i not in ids:
                ids.append(int(i))
    if not ids:
        raise UserError("the tokenizer defines no EOS token; cannot tell where an answer ends")
    return ids


def end_of_turn_id(tokenizer, stop_ids: list[int]) -> int:
    """The stop token an assistant turn actually ends with under the chat template.

    Not simply the first stop id: a generation config may list another one first (Llama-3-Instruct
    lists ``<|end_of_text|>`` before ``<|eot_id|>``), and padding with a token the answers never
    end with would teach nothing.
    """
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    return encode_conversation(tokenizer, probe, stop_ids=stop_ids).input_ids[-1]


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the tokenizer has no chat template; MARS fine-tunes instruction (chat) models")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _unicode(text: str) -> str:
    """``text``, if it is valid Unicode: a lone surrogate (from JSON's ``\\ud800`` or a command
    line's undecodable bytes) cannot be encoded, and tokenizers fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"the text holds a lone surrogate {text[exc.start]!r} (not valid Unicode) after "
            f"{text[max(0, exc.start - 30) : exc.start]!r}"
        ) from None
    return text


def _special_tokens(tokenizer) -> set[str]:
    """Every control token's spelling, the mask token's always: masks are the decoder's to place (an
    exact checkpoint's adapter acts at them), so no text becomes one, special in the tokenizer or not."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {t.content for t in added.values() if getattr(t, "special", False)}
    return set(tokenizer.all_special_tokens) | special | {MASK_TOKEN}


def _tokenize(tokenizer, messages: list[dict], add_generation_prompt: bool, offsets: bool = False):
    """``(text, encoding)``: ``messages`` rendered by the chat template, and its tokens. The template's
    own control tokens are parsed as such, but a message's content is text even where it spells one:
    an answer that quotes "<|im_end|>" must not end its turn there. Such a content is rendered as a
    placeholder and encoded on its own, special tokens split like any text."""
    text = _render(tokenizer, messages, add_generation_prompt)
    kwargs = dict(add_special_tokens=False, return_offsets_mapping=offsets)
    special = _special_tokens(tokenizer)
    marks = {
        i: f"\ue000marslm-content-{i}\ue000"
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), str) and any(t in m["content"] for t in special)
    }
    if not marks:
        return text, tokenizer(_unicode(text), **kwargs)
    spelling = {mark: messages[i]["content"] for i, mark in marks.items()}
    marked_messages = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
    marked = _render(tokenizer, marked_messages, add_generation_prompt)
    pieces = re.split("(" + "|".join(map(re.escape, spelling)) + ")", marked)
    if any(marked.count(mark) != 1 for mark in spelling) or "".join(spelling.get(p, p) for p in pieces) != text:
        raise UserError(
            "a message spells a control token and the chat template changes message text, so it cannot be kept as text"
        )
    ids, spans, start = [], [], 0
    for piece in pieces:
        piece_text = spelling.get(piece, piece)
        if piece_text:
            enc = tokenizer(_unicode(piece_text), split_special_tokens=piece in spelling, **kwargs)
            ids += enc["input_ids"]
            spans += [(a + start, b + start) for a, b in enc.get("offset_mapping", [])]
        start += len(piece_text)
    return text, {"input_ids": ids, "offset_mapping": spans}


def encode_prompt(tokenizer, prompt, apply_chat_template: bool = True) -> list[int]:
    """Token ids that a generation continues from.

    ``prompt`` is a user message (str), a message list, or already token ids.
    """
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int)):
        if not prompt:
            raise UserError("empty prompt")
        return [int(t) for t in prompt]
    if isinstance(prompt, str):
        if not prompt:
            raise UserError("empty prompt")
        if not apply_chat_template:
            return _raw_text_ids(tokenizer, prompt)
        prompt = [{"role": "user", "content": prompt}]
    return _tokenize(tokenizer, list(prompt), add_generation_prompt=True)[1]["input_ids"]


def _raw_text_ids(tokenizer, text: str) -> list[int]:
    """A raw prompt's tokens, its control tokens parsed as such (a raw prompt may write its own
    template) except the mask token, whose spelling stays text."""
    pieces = re.split(f"({re.escape(MASK_TOKEN)})", _unicode(text))
    return [
        t
        for piece in pieces
        if piece
        for t in tokenizer(piece, add_special_tokens=False, split_special_tokens=piece == MASK_TOKEN)["input_ids"]
    ]


def encode_conversation(
    tokenizer, messages: list[dict], max_length: int | None = None, stop_ids: list[int] | None = None
) -> EncodedChat:
    """Token ids and labels for one conversation, loss on assistant turns only.

    Each assistant span ends at its stop token (inclusive): template text after it, such as
    ChatML's trailing newline, is context, not target. The sequence is cut after the last
    assistant stop token, so every training sequence ends in EOS.
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise UserError("conversation has no assistant turn")
    stop_ids = stop_ids or stop_token_ids(tokenizer)
    full_text, enc = _tokenize(tokenizer, messages, add_generation_prompt=False, offsets=True)

    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not full_text.startswith(through) or not through.startswith(before):
            raise UserError(
                "the chat template does not render conversations prefix by prefix; cannot locate assistant turns"
            )
        spans.append((len(before), len(through)))

    input_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = [IGNORE] * len(input_ids)
    end_of_last_turn = 0
    for start, end in spans:
        inside = [t for t, (a, _) in enumerate(offsets) if start <= a < end]
        for t in inside:
            labels[t] = input_ids[t]
            if input_ids[t] in stop_ids:
                break
        else:
            raise UserError("an assistant turn does not end in an EOS token under this chat template")
        end_of_last_turn = t + 1

    input_ids, labels = input_ids[:end_of_last_turn], labels[:end_of_last_turn]
    truncated = max_length is not None and len(input_ids) > max_length
    if truncated:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return EncodedChat(input_ids, labels, truncated)


def encode_generated(
    tokenizer, messages: list[dict], answer_ids: list[int], finished: bool, eos_id: int, max_length: int | None = None
) -> EncodedChat:
    """A generated answer as a training example: the prompt as decoding encoded it, then the
    answer's token ids exactly as they were generated.

    Decoding the ids to text and encoding the text again can give other ids where the model chose
    a non-canonical split; training on those would teach the clean stream tokens the model did
    not say. A finished answer ends in ``eos_id``; a cut one (it reached the token limit) ends
    where it was cut, with no end-of-turn token, so nothing teaches the model to stop there.
    ``messages`` is the conversation up to the answer (a final assistant turn is ignored).
    """
    if messages and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    prompt = encode_prompt(tokenizer, messages)
    answer = [int(t) for t in answer_ids] + ([eos_id] if finished else [])
    input_ids, labels = prompt + answer, [IGNORE] * len(prompt) + answer
    truncated = max_length is not None and len(input_ids) > max_length
    if truncated:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return EncodedChat(input_ids, labels, truncated)
