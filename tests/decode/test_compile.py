"""``compile=True``: the step traces as one graph per bucket, with no graph break, and decodes
what the eager step decodes, token for token.

Most tests trace with dynamo's ``eager`` backend: ``fullgraph=True`` raises at the first graph
break whatever the backend, and the graph runs without code generation. One test runs inductor,
the backend users get.
"""

import pytest

import marslm
from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.decode import forward
from marslm.errors import UserError
from tests.trained import TRAIN_N

SETTINGS = {
    "tau 1": dict(tau=1.0),
    "threshold": dict(tau=0.6),
    "threshold, every step reads its masks": dict(tau=0.6, adaptive_width=False, mask_batch_limit=None),
    "lossless": dict(mode="lossless"),
    "hybrid": dict(mode="hybrid", tau=0.6),
    "lossless, draft groups": dict(mode="lossless", draft_groups=True),
}


@pytest.fixture
def traced(monkeypatch):
    monkeypatch.setattr(forward, "BACKEND", "eager")


def _prompts(tokenizer, n=4):
    return [encode_prompt(tokenizer, ex.messages) for ex in toy.make_split("train", TRAIN_N, seed=0)[::8][:n]]


def _both(model, tokenizer, prompts, max_new_tokens=40, **settings):
    eager = marslm.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, **settings)
    compiled = marslm.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, compile=True, **settings)
    return eager, compiled


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("checkpoint", ["toy", "exact"])
def test_the_compiled_step_has_no_graph_break_and_decodes_as_the_eager_one(
    traced, trained_checkpoints, exact64, checkpoint, setting
):
    model, tokenizer = trained_checkpoints["mars64"] if checkpoint == "toy" else exact64
    eager, compiled = _both(model, tokenizer, _prompts(tokenizer), **SETTINGS[setting])
    assert compiled.token_ids == eager.token_ids
    assert compiled.accepted_per_step == eager.accepted_per_step
    # every step after the one that filled the cache ran a compiled graph
    assert compiled.stats.compiled_steps == compiled.stats.forwards - 1 > 0


def test_a_random_llama_compiles_and_decodes_as_the_eager_step(traced, make_tiny_model, tiny_tokenizer):
    model = make_tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    for settings in (dict(tau=1.0), dict(tau=0.001, adaptive_width=False), dict(mode="lossless")):
        eager, compiled = _both(model, tiny_tokenizer, prompts, **settings)
        assert compiled.token_ids == eager.token_ids
        assert compiled.stats.compiled_steps == compiled.stats.forwards - 1 > 0
    assert compiled.tokens_per_forward == eager.tokens_per_forward


def test_later_calls_reuse_the_graphs_already_traced(traced, trained_checkpoints):
    model, tokenizer = trained_checkpoints["mars64"]
    prompts = _prompts(tokenizer, 1)
    first = marslm.generate(model, tokenizer, prompts, max_new_tokens=24, tau=1.0, compile=True)
    again = marslm.generate(model, tokenizer, prompts, max_new_tokens=24, tau=1.0, compile=True)
    assert first.stats.compile_seconds > 0 and again.stats.compile_seconds == 0
    assert again.token_ids == first.token_ids


def test_inductor_decodes_as_the_eager_step(trained_checkpoints):
    model, tokenizer = trained_checkpoints["mars64"]
    prompts = _prompts(tokenizer, 1)
    eager, compiled = _both(model, tokenizer, prompts, mode="lossless")
    assert compiled.token_ids == eager.token_ids and compiled.stats.compiled_steps > 0
    greedy = marslm.generate(model, tokenizer, prompts, max_new_tokens=40, tau=1.0, compile=True)
    assert greedy.token_ids == compiled.token_ids


@pytest.mark.parametrize("cache", ["none", "block"])
def test_compile_is_refused_where_the_step_is_not_the_cursor_caches(trained_checkpoints, cache):
    model, tokenizer = trained_checkpoints["mars64"]
    with pytest.raises(UserError, match="compile runs the cursor cache's step"):
        marslm.generate(model, tokenizer, ["hi"], cache=cache, compile=True)


def test_padding_is_never_kept_in_the_cache(traced, trained_checkpoints):
    """After every step the static cache holds what the eager one holds: padding columns and rows,
    and the masks, are dropped; the slots in use end where the eager cache's end."""
    from marslm.decode.batch import DecodeBatch
    from marslm.decode.kv import StaticSlotCache
    from marslm.decode.params import DecodingParams

    model, tokenizer = trained_checkpoints["mars64"]
    prompts = _prompts(tokenizer, 3)
    params = DecodingParams(tau=0.6, max_new_tokens=24).validate(4)
    batches = [
        DecodeBatch(model, mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"), stop_ids=[2], compile=c)
        for c in (False, True)
    ]
    for batch in batches:
        batch.add(prompts, [params] * 3, [0, 1, 2])
    while len(batches[0]):
        done = [batch.step() for batch in batches]
        assert done[0] == done[1]
        if len(batches[0]):
            eager, static = (b.kv.get_seq_length() for b in batches)
            assert static == eager
            assert (batches[1].rows.slot_valid == batches[0].rows.slot_valid).all()
            assert isinstance(batches[1].kv, StaticSlotCache)


def test_models_of_one_shape_never_share_a_graph(traced, trained_checkpoints, exact64):
    """The toy checkpoint and the exact one have the same shapes, and dynamo does not guard on
    hooks (the exact one's adapter): each model's graphs must be its own (forward._owner)."""
    prompts = _prompts(exact64[1])
    for model, tokenizer in (trained_checkpoints["mars64"], exact64):
        eager, compiled = _both(model, tokenizer, prompts, mode="lossless")
        assert compiled.accepted_per_step == eager.accepted_per_step


def test_padding_sees_only_itself_and_nothing_sees_padding():
    """A bucket's padding columns (between the real tokens and the masks) and padding rows each
    attend to their own slot alone, and no fed column attends to a padding slot: padding never
    changes a real output, and no padding row is masked out entirely (NaN keys in the cache)."""
    import numpy as np

    from marslm.decode.forward import columns, padded
    from marslm.decode.inputs import StepInputs

    n, real, masks, cached, width, rows, capacity = 3, 2, 3, 5, 8, 4, 16
    fed = real + masks
    mask = np.zeros((n, 1, fed, cached + fed), bool)
    mask[:, 0, :, :cached] = True
    mask[:, 0, :, cached:] = np.tril(np.ones((fed, fed), bool))
    step = StepInputs(
        input_ids=np.arange(n * fed).reshape(n, fed) + 10,
        position_ids=np.tile(cached + np.arange(fed), (n, 1)),
        mask=mask,
        read_cols=np.tile(np.arange(fed), (n, 1)),
        real_valid=np.ones((n, real), bool),
        pending_len=np.full(n, real),
        draft_valid=np.zeros((n, 0), bool),
        masks_read=np.full(n, masks),
        masks_per_group=masks,
        groups=1,
    )
    out = padded(step, rows=rows, width=width, cached=cached, capacity=capacity, pad_id=0)
    place = columns(step, width)
    assert list(place) == [0, 1, 5, 6, 7] and out.tail == masks  # the masks stay last
    is_pad = np.ones((rows, width), bool)
    is_pad[:n, place] = False
    seen = out.mask[:, 0]
    for r, c in zip(*np.nonzero(is_pad)):
        assert list(np.flatnonzero(seen[r, c])) == [cached + c]
    for r in range(n):
        pad_slots = cached + np.flatnonzero(is_pad[r])
        assert not seen[r][np.ix_(place, pad_slots)].any()
        assert (seen[r][np.ix_(place, np.r_[np.arange(cached), cached + place])] == mask[r, 0]).all()


def test_the_eager_prefill_runs_the_head_on_the_read_columns_alone(traced, trained_checkpoints):
    # a prompt's first step is too wide for a bucket and runs eagerly; a head over every prompt
    # column would cost a real vocabulary more than the rest of the step
    model, tokenizer = trained_checkpoints["mars64"]
    prompts = _prompts(tokenizer, n=2)
    head_columns = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, out: head_columns.append(args[0].shape[1]))
    try:
        marslm.generate(model, tokenizer, prompts, max_new_tokens=8, tau=0.6, compile=True)
    finally:
        hook.remove()
    # the AR token's column and the masks' (B = 4), not the prompt's
    assert max(map(len, prompts)) > 33 and head_columns[0] == 5
