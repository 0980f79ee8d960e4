"""Training only the top layers: the backward pass must stop at the lowest trained layer.

`--train-layers N` freezes the embeddings (with tied embeddings, the output projection too) and
every layer below the top N, so autograd never builds a graph below them. Checked on the tiny
tied-embedding models: gradients land only on the trained layers, and the input of the lowest
trained layer does not require grad (the backward pass cannot go below it).
"""

import copy

import pytest
import torch

from marslm.chat import encode_conversation, stop_token_ids
from marslm.errors import UserError
from marslm.modeling import count_parameters
from marslm.training.collate import collate
from marslm.training.objective import LossOptions, mars_loss
from marslm.training.surgery import ensure_mask_token, freeze_for_training
from tests.helpers import chat_conversations


def _mars_batch(model, tokenizer):
    stop = stop_token_ids(tokenizer, model.generation_config)
    examples = []
    for messages in chat_conversations(3, seed=1):
        enc = encode_conversation(tokenizer, messages, stop_ids=stop)
        examples.append({"input_ids": enc.input_ids, "labels": enc.labels})
    return collate(examples, pad_id=tokenizer.pad_token_id, block_size=4, eos_id=stop[0])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_train_layers_stops_the_backward_at_the_lowest_trained_layer(make_tiny_model, tiny_tokenizer, arch):
    model = make_tiny_model(arch=arch).train()
    assert model.config.tie_word_embeddings
    mask_id = ensure_mask_token(model, tiny_tokenizer)
    layers = model.get_decoder().layers
    split = freeze_for_training(model, train_layers=1)
    assert split["trainable"] + split["frozen"] == count_parameters(model)
    assert split["trainable"] == sum(p.numel() for p in layers[-1].parameters()) + sum(
        p.numel() for p in model.get_decoder().norm.parameters()
    )

    seen = {}
    layers[-1].register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(
            needs_grad=(args[0] if args else kwargs["hidden_states"]).requires_grad
        ),
        with_kwargs=True,
    )
    batch = _mars_batch(model, tiny_tokenizer)
    mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, mask_id))["loss"].backward()
    assert seen["needs_grad"] is False  # nothing below the top layer is in the graph
    assert all(p.grad is not None for p in layers[-1].parameters())
    assert all(p.grad is None for layer in layers[:-1] for p in layer.parameters())
    assert model.get_input_embeddings().weight.grad is None


def test_freeze_embeddings_keeps_every_layer_trainable(make_tiny_model):
    model = make_tiny_model()
    split = freeze_for_training(model, freeze_embeddings=True)
    assert not model.get_input_embeddings().weight.requires_grad
    assert not model.get_output_embeddings().weight.requires_grad  # tied: the same matrix
    assert all(p.requires_grad for layer in model.get_decoder().layers for p in layer.parameters())
    assert split["frozen"] == model.get_input_embeddings().weight.numel()


def test_train_layers_out_of_range_is_a_user_error(make_tiny_model):
    model = make_tiny_model()
    with pytest.raises(UserError, match="--train-layers must be in 1..2"):
        freeze_for_training(model, train_layers=3)


def test_a_grown_mask_row_is_the_mean_embedding_and_never_the_greedy_choice(make_tiny_model, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    model = make_tiny_model(vocab_size=len(tokenizer))  # no spare row
    mask_id = ensure_mask_token(model, tokenizer, mask_token="<|other_mask|>")
    weight = model.get_input_embeddings().weight
    assert mask_id == weight.shape[0] - 1 == len(tiny_tokenizer)
    torch.testing.assert_close(weight[mask_id], weight[:mask_id].mean(dim=0))
    # tied: the row is also the output row, whose logit is the mean logit, below the top one
    logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits[0]
    assert (logits[:, mask_id] < logits.max(dim=-1).values).all()


@pytest.mark.parametrize("train_layers", [None, 1])
def test_activation_checkpointing_keeps_gradients_and_the_frozen_layers_out_of_the_backward(
    make_tiny_model, tiny_tokenizer, train_layers
):
    """Same loss and gradients with checkpointing; a trained layer runs its forward twice (the
    recompute), a frozen one once, and nothing below the trained layers gets a gradient."""
    from marslm.training.surgery import enable_activation_checkpointing

    def run(checkpointing):
        model = make_tiny_model(seed=5).train()
        mask_id = ensure_mask_token(model, tiny_tokenizer)
        freeze_for_training(model, train_layers=train_layers)
        if checkpointing:
            enable_activation_checkpointing(model)
        layers = model.get_decoder().layers
        calls = [0] * len(layers)
        for i, layer in enumerate(layers):  # the recompute replays the layer's forward, not its hooks
            layer.mlp.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        batch = _mars_batch(model, tiny_tokenizer)
        loss = mars_loss(model, batch["input_ids"], batch["labels"], LossOptions(4, mask_id))["loss"]
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return loss.detach(), grads, calls

    loss, grads, plain_calls = run(False)
    ck_loss, ck_grads, ck_calls = run(True)
    torch.testing.assert_close(ck_loss, loss)
    for name, grad in grads.items():
        if grad is None:
            assert ck_grads[name] is None, name  # frozen stays frozen
        else:
            torch.testing.assert_close(ck_grads[name], grad, rtol=1e-5, atol=1e-7)
    assert plain_calls == [1] * len(plain_calls)
    n = len(ck_calls)
    trained = n if train_layers is None else train_layers
    assert ck_calls == [1] * (n - trained) + [2] * trained
