"""The MARS objective (docs/method.md): two-stream forward, loss, labels and padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from marslm.chat import IGNORE, encode_conversation
from marslm.masks import for_attention, two_stream_mask
from marslm.training.collate import collate, collate_packed, pad_to_block
from marslm.training.objective import LossOptions, ar_loss, mars_loss, two_stream_batch
from tests.helpers import assert_same_loss_and_grads, chat_conversations, stage_loss_and_grads

MASK_ID = 3
EOS_ID = 2
PAD_ID = 0


def batch_of(tokenizer, n=3, block_size=4, seed=0):
    examples = []
    for messages in chat_conversations(n, seed=seed):
        enc = encode_conversation(tokenizer, messages)
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    return collate(examples, pad_id=PAD_ID, block_size=block_size, eos_id=EOS_ID)


def mars_forward(model, input_ids, labels, block_size, ar_weight=1.0, normalization="token"):
    """Run mars_loss and capture the clean and noisy logits of its forward, each ``[batch, L, vocab]``.

    The batch leaves out noisy copies no loss needs; their logits are returned as zeros.
    """
    captured = {}

    def hook(module, args, kwargs, output):
        captured["logits"] = output.logits  # returns None: the output is left as is

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        terms = mars_loss(
            model,
            input_ids,
            labels,
            LossOptions(block_size, MASK_ID, ar_weight=ar_weight, normalization=normalization, target_logits=False),
        )
    finally:
        handle.remove()
    L = input_ids.shape[1]
    logits = captured["logits"].detach()
    columns = two_stream_batch(input_ids, labels, block_size, MASK_ID).noisy_columns
    assert logits.shape[1] == L + columns.shape[1]
    noisy = torch.zeros_like(logits[:, :L])
    for row in range(len(columns)):
        real = columns[row] >= 0
        noisy[row, columns[row][real]] = logits[row, L:][real]
    return terms, logits[:, :L], noisy


def manual_ce(logits, labels, normalization="token", row_weights=None):
    """CE of output t-1 against response target t, written out position by position.

    token: the mean over every target of the batch. sequence (one sequence per row): each row's
    mean, then the mean over rows. ``row_weights`` multiplies each row's losses.
    """
    rows = []
    for row in range(labels.shape[0]):
        losses = [
            F.cross_entropy(logits[row, t - 1].float()[None], labels[row, t][None])
            for t in range(1, labels.shape[1])
            if labels[row, t] != IGNORE
        ]
        weight = 1.0 if row_weights is None else row_weights[row]
        rows.append([weight * loss for loss in losses])
    if normalization == "token":
        return torch.stack([loss for row in rows for loss in row]).mean()
    return torch.stack([torch.stack(row).mean() for row in rows]).mean()


# ------------------------------------------------------------------ no leakage


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa")])
@pytest.mark.parametrize("block_size", [3, 4])
def test_no_leakage_from_clean_block_to_its_own_noisy_outputs(tiny_tokenizer, make_tiny_model, arch, attn, block_size):
    model = make_tiny_model(arch, attn)
    batch = batch_of(tiny_tokenizer, n=1, block_size=block_size)
    ids, labels = batch["input_ids"], batch["labels"]
    L = ids.shape[1]
    n_blocks = L // block_size
    response = (labels[0] != IGNORE).nonzero().flatten()
    _, _, noisy_ref = mars_forward(model, ids, labels, block_size)
    gen = torch.Generator().manual_seed(0)

    checked = 0
    for k in range(n_blocks - 1):
        in_block = response[(response >= k * block_size) & (response < (k + 1) * block_size)]
        if not len(in_block):
            continue
        changed = ids.clone()
        new = torch.randint(4, len(tiny_tokenizer), (len(in_block),), generator=gen)
        new = torch.where(new == ids[0, in_block], 4 + (new - 3) % (len(tiny_tokenizer) - 4), new)
        changed[0, in_block] = new
        assert not torch.equal(changed, ids)
        _, _, noisy = mars_forward(model, changed, labels, block_size)
        upto = (k + 1) * block_size
        assert torch.allclose(noisy[:, :upto], noisy_ref[:, :upto], atol=1e-6, rtol=0), (
            f"clean block {k} leaked into noisy blocks <= {k}"
        )
        nxt = slice(upto, upto + block_size)
        assert not torch.allclose(noisy[:, nxt], noisy_ref[:, nxt], atol=1e-4, rtol=0), (
            f"noisy block {k + 1} does not see clean block {k}"
        )
        checked += 1
    assert checked >= 3


def test_noisy_response_tokens_do_not_matter(tiny_tokenizer, make_tiny_model):
    """The noisy stream never sees the response tokens themselves, only <|mask|>."""
    model = make_tiny_model()
    batch = batch_of(tiny_tokenizer, n=2)
    ids, labels = batch["input_ids"], batch["labels"]
    # changing the LAST block's clean response tokens can change nothing in the noisy stream
    L = ids.shape[1]
    last = torch.zeros_like(ids, dtype=torch.bool)
    last[:, L - 4 :] = True
    changed = torch.where(last & (labels != IGNORE), torch.full_like(ids, 7), ids)
    assert not torch.equal(changed, ids)
    _, _, noisy_ref = mars_forward(model, ids, labels, 4)
    _, clean, noisy = mars_forward(model, changed, labels, 4)
    assert torch.allclose(noisy, noisy_ref, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ clean half == AR


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa"), ("llama", "eager")])
def test_clean_half_equals_plain_causal_forward(tiny_tokenizer, make_tiny_model, arch, attn):
    model = make_tiny_model(arch, attn)
    batch = batch_of(tiny_tokenizer, n=3)
    _, clean, _ = mars_forward(model, batch["input_ids"], batch["labels"], 4)
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"]).logits
    assert torch.allclose(clean, plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_sdpa_and_eager_agree(tiny_tokenizer, make_tiny_model, arch):
    sdpa = make_tiny_model(arch, "sdpa", seed=1)
    eager = make_tiny_model(arch, "eager", seed=2)
    eager.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    batch = batch_of(tiny_tokenizer, n=3, block_size=4)
    terms_s, clean_s, noisy_s = mars_forward(sdpa, batch["input_ids"], batch["labels"], 4)
    terms_e, clean_e, noisy_e = mars_forward(eager, batch["input_ids"], batch["labels"], 4)
    assert torch.allclose(clean_s, clean_e, atol=1e-5, rtol=0)
    assert torch.allclose(noisy_s, noisy_e, atol=1e-5, rtol=0)
    assert torch.allclose(terms_s["loss"], terms_e["loss"], atol=1e-5)


def test_eager_with_a_boolean_mask_would_be_wrong(tiny_tokenizer, make_tiny_model):
    """Guards the sdpa/eager test: without for_attention's conversion eager really differs."""
    eager = make_tiny_model("qwen2", "eager")
    batch = batch_of(tiny_tokenizer, n=1)
    tsb = two_stream_batch(batch["input_ids"], batch["labels"], 4, MASK_ID)
    _, _, noisy_ok = mars_forward(eager, batch["input_ids"], batch["labels"], 4)
    with torch.no_grad():
        wrong = eager(
            input_ids=tsb.input_ids, position_ids=tsb.position_ids, attention_mask=tsb.attention_mask.float()
        ).logits
    L = batch["input_ids"].shape[1]
    kept = tsb.noisy_columns[0]
    assert not torch.allclose(wrong[0, L:], noisy_ok[0, kept], atol=1e-3)


# ------------------------------------------------------------------ loss


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_loss_terms(tiny_tokenizer, make_tiny_model, normalization):
    model = make_tiny_model()
    batch = batch_of(tiny_tokenizer, n=3, seed=2)
    ids, labels = batch["input_ids"], batch["labels"]
    assert len(set((labels != IGNORE).sum(dim=1).tolist())) > 1  # the two normalisations differ here
    with torch.no_grad():
        t0, clean, noisy = mars_forward(model, ids, labels, 4, ar_weight=0.0, normalization=normalization)
        t_half, _, _ = mars_forward(model, ids, labels, 4, ar_weight=0.5, normalization=normalization)
        t_one, _, _ = mars_forward(model, ids, labels, 4, normalization=normalization)
    noisy_ce, clean_ce = manual_ce(noisy, labels, normalization), manual_ce(clean, labels, normalization)
    assert not torch.isclose(noisy_ce, clean_ce, atol=1e-3)
    # ar_weight=0: the noisy-only loss (the paper's "w/o SFT loss")
    assert torch.isclose(t0["loss"], noisy_ce, atol=1e-5)
    assert torch.isclose(t0["noisy_loss"], noisy_ce, atol=1e-5)
    assert torch.isclose(t0["clean_loss"], clean_ce, atol=1e-5)
    assert torch.isclose(t_half["loss"], noisy_ce + 0.5 * clean_ce, atol=1e-5)
    assert torch.isclose(t_one["loss"], noisy_ce + clean_ce, atol=1e-5)
    # the clean term is exactly the AR SFT loss, and that is transformers' own causal LM loss
    with torch.no_grad():
        ar = ar_loss(model, ids, labels, normalization=normalization)
        hf = model(input_ids=ids, labels=labels).loss
    assert torch.isclose(ar["loss"], clean_ce, atol=1e-5)
    if normalization == "token":
        assert torch.isclose(ar["loss"], hf, atol=1e-5)


def test_inverse_t_weighting_of_the_masked_stream(tiny_tokenizer, make_tiny_model):
    """Each sequence's masked-stream loss times 1/t, t ~ U(1e-3, 1) drawn per sequence, as the
    reference's w/o-SFT trainer does; the clean stream is left alone."""
    from marslm.training.objective import T_MIN

    model = make_tiny_model()
    batch = batch_of(tiny_tokenizer, n=3, seed=2)
    ids, labels = batch["input_ids"], batch["labels"]
    torch.manual_seed(11)
    t = T_MIN + (1 - T_MIN) * torch.rand(3)
    torch.manual_seed(11)
    with torch.no_grad():
        terms = mars_loss(model, ids, labels, LossOptions(4, MASK_ID, ar_weight=0.0, masked_weighting="inverse-t"))
        _, clean, noisy = mars_forward(model, ids, labels, 4, normalization="sequence")
    expected = manual_ce(noisy, labels, "sequence", row_weights=(1 / t).tolist())
    assert torch.isclose(terms["loss"], expected, rtol=1e-5)
    assert torch.isclose(terms["clean_loss"], manual_ce(clean, labels, "sequence"), atol=1e-5)


def literal_mars_loss(model, input_ids, labels, block_size, ar_weight=1.0, normalization="token"):
    """The objective exactly as docs/method.md writes it: z = [x ; x~], full length, one sequence per row."""
    L = input_ids.shape[1]
    noisy_ids = torch.where(labels != IGNORE, MASK_ID, input_ids)
    mask = for_attention(two_stream_mask(L, block_size)[None, None], model)
    logits = model(
        input_ids=torch.cat([input_ids, noisy_ids], dim=1),
        position_ids=torch.arange(L).repeat(2)[None].expand(len(input_ids), -1),
        attention_mask=mask,
    ).logits
    return manual_ce(logits[:, L:], labels, normalization) + ar_weight * manual_ce(logits[:, :L], labels, normalization)


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_batch_without_unneeded_noisy_copies_gives_the_literal_loss_and_gradients(
    tiny_tokenizer, make_tiny_model, attn, block_size, normalization
):
    from marslm.data import toy

    examples = []
    for example in toy.make_split("train", 6):  # prompts of different lengths
        enc = encode_conversation(tiny_tokenizer, toy.to_chat_record(example)["messages"])
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    batch = collate(examples, pad_id=PAD_ID, block_size=block_size, eos_id=EOS_ID)
    ids, labels = batch["input_ids"], batch["labels"]
    tsb = two_stream_batch(ids, labels, block_size, MASK_ID)
    assert tsb.input_ids.shape[1] < 1.8 * ids.shape[1]  # it did leave columns out

    def loss_and_grads(loss_fn):
        model = make_tiny_model("qwen2", attn, seed=6)
        loss = loss_fn(model)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    ours, our_grads = loss_and_grads(
        lambda m: mars_loss(
            m, ids, labels, LossOptions(block_size, MASK_ID, ar_weight=0.5, normalization=normalization)
        )["loss"]
    )
    literal, literal_grads = loss_and_grads(
        lambda m: literal_mars_loss(m, ids, labels, block_size, ar_weight=0.5, normalization=normalization)
    )
    torch.testing.assert_close(ours, literal, rtol=1e-5, atol=1e-5)
    for name in literal_grads:
        torch.testing.assert_close(our_grads[name], literal_grads[name], rtol=1e-4, atol=1e-6)


def test_loss_only_on_response_targets(tiny_tokenizer, make_tiny_model):
    """Changing a prompt-side label to IGNORE-equivalent has no effect; changing targets does."""
    model = make_tiny_model()
    batch = batch_of(tiny_tokenizer, n=2)
    ids, labels = batch["input_ids"], batch["labels"]
    with torch.no_grad():
        ref = mars_loss(model, ids, labels, LossOptions(4, MASK_ID))
        fewer = labels.clone()
        first = (labels[0] != IGNORE).nonzero()[0, 0]
        fewer[0, first] = IGNORE  # one target less: the loss must change
        other = mars_loss(model, ids, fewer, LossOptions(4, MASK_ID))
    assert not torch.isclose(ref["loss"], other["loss"], atol=1e-6)


def expected_labels(tokenizer, ids):
    """Labels from the ChatML token stream: assistant content and its <|im_end|>, nothing else."""
    im_start, im_end = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.eos_token_id
    labels, t = [IGNORE] * len(ids), 0
    while t < len(ids):
        if ids[t] != im_start:
            t += 1
            continue
        header_end = t + 1
        while not tokenizer.decode(ids[t + 1 : header_end + 1]).endswith("\n"):
            header_end += 1
        role = tokenizer.decode(ids[t + 1 : header_end + 1]).strip()
        t = header_end + 1
        while t < len(ids) and ids[t] != im_end:
            if role == "assistant":
                labels[t] = ids[t]
            t += 1
        if t < len(ids) and role == "assistant":
            labels[t] = ids[t]
        t += 1
    return labels


def test_encode_conversation_labels(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 3 plus 4?"},
        {"role": "assistant", "content": "3 plus 4 is 7. The answer is 7."},
        {"role": "user", "content": "What is 9 minus 2?"},
        {"role": "assistant", "content": "9 minus 2 is 7. The answer is 7."},
    ]
    enc = encode_conversation(tiny_tokenizer, messages)
    ids, labels = enc.input_ids, enc.labels
    assert len(ids) == len(labels) and not enc.truncated
    assert labels == expected_labels(tiny_tokenizer, ids)
    # both answers are targets, verbatim, each with its EOS
    targets = [t for t in labels if t != IGNORE]
    assert tiny_tokenizer.decode(targets) == (
        "3 plus 4 is 7. The answer is 7.<|im_end|>9 minus 2 is 7. The answer is 7.<|im_end|>"
    )
    assert labels.count(EOS_ID) == 2
    # the sequence ends with the EOS; the template's trailing newline is not part of it
    assert ids[-1] == EOS_ID and labels[-1] == EOS_ID
    full = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert full.endswith("<|im_end|>\n")
    assert tiny_tokenizer.decode(ids) == full[:-1]
    # the newline after the first answer's EOS is context, not target
    first_target = next(t for t, label in enumerate(labels) if label != IGNORE)
    first_eos = ids.index(EOS_ID, first_target)
    assert labels[first_eos] == EOS_ID and labels[first_eos + 1] == IGNORE
    assert tiny_tokenizer.decode([ids[first_eos + 1]]) == "\n"
    # the system and user text carries no label
    assert tiny_tokenizer.decode(ids[:first_target]).endswith("<|im_start|>assistant\n")
    assert "3 plus 4 is" not in tiny_tokenizer.decode(ids[:first_target])


def test_encode_conversation_truncation(tiny_tokenizer):
    messages = chat_conversations(1)[0]
    full = encode_conversation(tiny_tokenizer, messages)
    cut = encode_conversation(tiny_tokenizer, messages, max_length=len(full.input_ids) - 3)
    assert cut.truncated and not full.truncated
    assert cut.input_ids == full.input_ids[:-3] and cut.labels == full.labels[:-3]


# ------------------------------------------------------------------ block padding


def test_pad_to_block_trains_the_padding_eos():
    ids, labels = [1, 5, 6, 7, 8, EOS_ID], [IGNORE, IGNORE, IGNORE, 7, 8, EOS_ID]
    padded_ids, padded_labels = pad_to_block(ids, labels, 4, EOS_ID)
    assert padded_ids == ids + [EOS_ID, EOS_ID]
    assert padded_labels == labels + [EOS_ID, EOS_ID]
    # already a block multiple: unchanged
    assert pad_to_block(ids, labels, 3, EOS_ID) == (ids, labels)
    assert pad_to_block(ids, labels, 1, EOS_ID) == (ids, labels)
    # B larger than the sequence
    assert pad_to_block(ids, labels, 16, EOS_ID) == (ids + [EOS_ID] * 10, labels + [EOS_ID] * 10)


def test_pad_to_block_truncated_sequence_is_not_trained():
    ids, labels = [1, 5, 6, 7, 8], [IGNORE, IGNORE, 6, 7, 8]  # cut mid-answer: no final EOS
    padded_ids, padded_labels = pad_to_block(ids, labels, 4, EOS_ID)
    assert padded_ids == ids + [EOS_ID] * 3
    assert padded_labels == labels + [IGNORE] * 3


def test_collate_pads_each_sequence_to_a_block_multiple():
    a = {"input_ids": [1, 5, 6, EOS_ID], "labels": [IGNORE, IGNORE, 6, EOS_ID]}  # 4
    b = {"input_ids": [1, 5, 6, 7, 8, 9, EOS_ID], "labels": [IGNORE, 5, 6, 7, 8, 9, EOS_ID]}  # 7
    c = {"input_ids": [1, 5, 6, 7, 8], "labels": [IGNORE, IGNORE, 6, 7, 8]}  # 5, truncated
    out = collate([a, b, c], pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    assert out["input_ids"].shape == out["labels"].shape == (3, 8)
    assert out["input_ids"].dtype == out["labels"].dtype == torch.long
    assert out["input_ids"][0].tolist() == [1, 5, 6, EOS_ID] + [PAD_ID] * 4
    assert out["labels"][0].tolist() == [IGNORE, IGNORE, 6, EOS_ID] + [IGNORE] * 4
    assert out["input_ids"][1].tolist() == [1, 5, 6, 7, 8, 9, EOS_ID, EOS_ID]
    assert out["labels"][1].tolist() == [IGNORE, 5, 6, 7, 8, 9, EOS_ID, EOS_ID]
    assert out["input_ids"][2].tolist() == [1, 5, 6, 7, 8, EOS_ID, EOS_ID, EOS_ID]
    assert out["labels"][2].tolist() == [IGNORE, IGNORE, 6, 7, 8, IGNORE, IGNORE, IGNORE]
    # AR collation (block 1) only right-pads, untrained
    ar = collate([a, b], pad_id=PAD_ID)
    assert ar["input_ids"][0].tolist() == [1, 5, 6, EOS_ID, PAD_ID, PAD_ID, PAD_ID]
    assert ar["labels"][0].tolist() == [IGNORE, IGNORE, 6, EOS_ID, IGNORE, IGNORE, IGNORE]


def test_collate_packed_fills_rows_first_fit_longest_first():
    a = {"input_ids": [1, 5, 6, EOS_ID], "labels": [IGNORE, IGNORE, 6, EOS_ID]}  # 4
    b = {"input_ids": [1, 5, 6, 7, 8, 9, EOS_ID], "labels": [IGNORE, 5, 6, 7, 8, 9, EOS_ID]}  # 7
    c = {"input_ids": [1, 7, EOS_ID], "labels": [9, IGNORE, EOS_ID]}  # 3
    out = collate_packed([a, b, c], pad_id=PAD_ID, row_width=7)
    # rows of 7: b alone, then a + c
    assert out["input_ids"].tolist() == [[1, 5, 6, 7, 8, 9, EOS_ID], [1, 5, 6, EOS_ID, 1, 7, EOS_ID]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 0, 1, 2]]
    assert out["segment_ids"].tolist() == [[0] * 7, [0, 0, 0, 0, 1, 1, 1]]
    # a sequence's first label is never a target: the previous sequence's last token would predict it
    assert out["labels"].tolist() == [
        [IGNORE, 5, 6, 7, 8, 9, EOS_ID],
        [IGNORE, IGNORE, 6, EOS_ID, IGNORE, IGNORE, EOS_ID],
    ]
    blocks = collate_packed([a, c], pad_id=PAD_ID, block_size=4, eos_id=EOS_ID, row_width=4)  # c EOS-padded to 4
    assert blocks["input_ids"].tolist() == [[1, 5, 6, EOS_ID], [1, 7, EOS_ID, EOS_ID]]
    assert blocks["segment_ids"].tolist() == [[0] * 4, [0] * 4]
    padded_row = collate_packed([b, a], pad_id=PAD_ID, row_width=7)
    assert padded_row["segment_ids"][1].tolist() == [0, 0, 0, 0, -1, -1, -1]
    assert padded_row["labels"][1, 4:].tolist() == [IGNORE] * 3
    default = collate_packed([a, b, c], pad_id=PAD_ID)  # rows 1.5x the longest (7 -> 11): b + a, then c
    assert default["input_ids"].shape == (2, 11)
    assert default["segment_ids"][0].tolist() == [0] * 7 + [1] * 4


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_packed_batches_give_the_padded_loss_and_gradients(tiny_tokenizer, make_tiny_model, stage, normalization):
    from marslm.data import toy

    examples = []
    for example in toy.make_split("train", 8):  # lengths differ by family: lists are short
        enc = encode_conversation(tiny_tokenizer, toy.to_chat_record(example)["messages"])
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    block_size = 4 if stage == "mars" else 1
    padded = collate(examples, pad_id=PAD_ID, block_size=block_size, eos_id=EOS_ID)
    packed = collate_packed(examples, pad_id=PAD_ID, block_size=block_size, eos_id=EOS_ID)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # it did pack something

    def run(batch):
        return stage_loss_and_grads(make_tiny_model(seed=4), batch, stage, normalization=normalization)

    assert_same_loss_and_grads(run(packed), run(padded))


# ------------------------------------------------------------------ training


def test_training_steps_lower_both_loss_terms(tiny_tokenizer, make_tiny_model):
    torch.manual_seed(0)
    model = make_tiny_model(seed=3)
    batch = batch_of(tiny_tokenizer, n=4, block_size=4, seed=5)
    ids, labels = batch["input_ids"], batch["labels"]

    def evaluate():
        model.eval()
        with torch.no_grad():
            return mars_loss(model, ids, labels, LossOptions(4, MASK_ID))

    before = evaluate()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(8):
        optimizer.zero_grad()
        mars_loss(model, ids, labels, LossOptions(4, MASK_ID))["loss"].backward()
        optimizer.step()
    after = evaluate()
    assert after["noisy_loss"] < before["noisy_loss"] - 0.1
    assert after["clean_loss"] < before["clean_loss"] - 0.1
    assert after["loss"] < before["loss"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mars_loss_backprops(tiny_tokenizer, make_tiny_model, arch, attn):
    model = make_tiny_model(arch, attn).train()
    batch = batch_of(tiny_tokenizer, n=2, block_size=4)
    terms = mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, MASK_ID))
    assert set(terms) == {"loss", "noisy_loss", "clean_loss"}
    assert torch.isfinite(terms["loss"]) and terms["loss"].requires_grad
    assert not terms["noisy_loss"].requires_grad and not terms["clean_loss"].requires_grad
    terms["loss"].backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    embed = model.get_input_embeddings().weight.grad
    assert embed[MASK_ID].abs().sum() > 0  # the mask token's embedding is trained
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_flex_attention_gives_the_sdpa_and_eager_loss(tiny_tokenizer, make_tiny_model, stage, packed, monkeypatch):
    """FlexAttention's block mask (masks.two_stream_block_mask) against the dense mask under sdpa and
    eager. torch has no FlexAttention backward on a CPU: there the loss is compared, and on a GPU
    the gradients too (marslm/bench/gpu_probe.py measures it there as well)."""
    from marslm.data import toy

    if not torch.cuda.is_available():
        # transformers compiles flex_attention; inductor's CPU template fails to build a mask_mod
        # that reads tensors, so the CPU check runs torch's uncompiled FlexAttention
        from torch.nn.attention.flex_attention import flex_attention
        from transformers.integrations import flex_attention as hf_flex

        monkeypatch.setattr(
            hf_flex,
            "compile_friendly_flex_attention",
            lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw),
        )

    examples = []
    for example in toy.make_split("train", 6):
        enc = encode_conversation(tiny_tokenizer, toy.to_chat_record(example)["messages"])
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    block_size = 4 if stage == "mars" else 1
    batch = (collate_packed if packed else collate)(examples, pad_id=PAD_ID, block_size=block_size, eos_id=EOS_ID)
    extra = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    extra = {k: v.to(device) for k, v in extra.items()}

    def loss_and_grads(attn):
        model = make_tiny_model("llama", attn, seed=3).to(device).train()
        with torch.set_grad_enabled(device == "cuda"):
            if stage == "mars":
                loss = mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, MASK_ID), **extra)["loss"]
            else:
                loss = ar_loss(model, batch["input_ids"], batch["labels"], **extra)["loss"]
        if device == "cpu":
            return loss, {}
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    flex, flex_grads = loss_and_grads("flex_attention")
    for attn in ("sdpa", "eager"):
        loss, grads = loss_and_grads(attn)
        torch.testing.assert_close(flex, loss, rtol=1e-5, atol=1e-5)
        for name in grads:
            torch.testing.assert_close(flex_grads[name], grads[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_split_by_stream_gives_the_whole_mask_s_loss_and_gradients(
    tiny_tokenizer, make_tiny_model, packed, monkeypatch
):
    """masks.two_stream_sdpa attends the clean queries over the clean keys alone (causally where a
    row holds one sequence): the loss and gradients of one call over the whole mask, in float64,
    with two noisy copies at random phases."""
    from marslm.data import toy
    from marslm.training import objective
    from marslm.training.objective import Masking

    examples = []
    for example in toy.make_split("train", 6):
        enc = encode_conversation(tiny_tokenizer, toy.to_chat_record(example)["messages"])
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    batch = (collate_packed if packed else collate)(examples, pad_id=PAD_ID, block_size=4, eos_id=EOS_ID)
    masking = Masking(random_phase=True, streams=2)

    def run():
        torch.manual_seed(0)  # the phases
        return stage_loss_and_grads(make_tiny_model("llama", seed=5).double(), batch, "mars", masking=masking)

    split = run()
    monkeypatch.setattr(objective, "split_attention", lambda *args: {})
    whole = run()
    assert_same_loss_and_grads(split, whole, loss_atol=1e-12)
