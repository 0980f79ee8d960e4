"""The training options that decide what trains and how: mask-only, the mask row's own learning
rate, LoRA merged at save, activation checkpointing, precision, attention and the vocabulary size."""

from __future__ import annotations

import pytest
import torch

from marslm.errors import UserError
from marslm.modeling import count_parameters
from marslm.training.config import TrainConfig
from marslm.training.recipe import _attn_implementation, _refuse_data_parallel, _use_bf16, train
from tests.test_train import load, run_cli, tokenizer_without_mask


def _train(base, data, out, callbacks=(), **options):
    cfg = TrainConfig(
        stage=options.pop("stage", "mars"),
        model=str(base),
        data=str(data),
        output=str(out),
        max_steps=options.pop("max_steps", 3),
        batch_size=2,
        learning_rate=options.pop("learning_rate", 1e-2),
        progress=False,
        save_steps=100,
        **options,
    )
    train(cfg, callbacks=callbacks)
    return load(out)[0]


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


@pytest.fixture
def base(tiny_model_dir):
    return tiny_model_dir


def _changed(before, after) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


def test_mask_only_trains_nothing_but_the_mask_row(base, write_chat_jsonl, tmp_path):
    original, tokenizer = load(base)
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    model = _train(base, write_chat_jsonl(tmp_path / "d.jsonl", 6), tmp_path / "out", mask_only=True)
    before, after = _weights(original), _weights(model)
    embed = "model.embed_tokens.weight"
    assert _changed(before, after) <= {embed, "lm_head.weight"}  # tied: one matrix
    rows = (before[embed] != after[embed]).any(dim=1).nonzero().flatten().tolist()
    assert rows == [mask_id]


def test_mask_lr_trains_the_mask_row_beside_the_top_layers(base, write_chat_jsonl, tmp_path):
    original, tokenizer = load(base)
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    from transformers import TrainerCallback

    groups = []

    class SeeOptimizer(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
            embedding = model.get_input_embeddings().weight
            groups.extend(
                (g.get("initial_lr", g["lr"]), any(p is embedding for p in g["params"])) for g in optimizer.param_groups
            )

    model = _train(
        base,
        write_chat_jsonl(tmp_path / "d.jsonl", 6),
        tmp_path / "out",
        callbacks=[SeeOptimizer()],
        train_layers=1,
        mask_lr=5e-2,
    )
    assert (5e-2, True) in groups and (1e-2, True) not in groups
    before, after = _weights(original), _weights(model)
    changed = _changed(before, after)
    n = original.config.num_hidden_layers
    assert any(name.startswith(f"model.layers.{n - 1}.") for name in changed)
    assert not any(name.startswith(f"model.layers.{i}.") for i in range(n - 1) for name in changed)
    embed = "model.embed_tokens.weight"
    assert (before[embed] != after[embed]).any(dim=1).nonzero().flatten().tolist() == [mask_id]


def test_lora_is_merged_into_a_plain_checkpoint(base, write_chat_jsonl, tmp_path):
    pytest.importorskip("peft")
    original, _ = load(base)
    out = tmp_path / "out"
    model = _train(base, write_chat_jsonl(tmp_path / "d.jsonl", 6), out, lora_rank=4, train_layers=1)
    assert not (out / "adapter_config.json").exists()
    assert count_parameters(model) == count_parameters(original)
    before, after = _weights(original), _weights(model)
    assert before.keys() == after.keys()  # no lora_A / lora_B left
    changed = _changed(before, after)
    n = original.config.num_hidden_layers
    assert changed and all(name.startswith(f"model.layers.{n - 1}.") for name in changed)


def test_lora_modules_choose_the_linears_it_adapts(base, write_chat_jsonl, tmp_path):
    pytest.importorskip("peft")
    original, _ = load(base)
    data = write_chat_jsonl(tmp_path / "d.jsonl", 6)
    model = _train(base, data, tmp_path / "out", lora_rank=4, lora_modules=["q_proj", "down_proj"])
    changed = _changed(_weights(original), _weights(model))
    assert changed and {name.split(".")[-2] for name in changed} == {"q_proj", "down_proj"}


def test_activation_checkpointing_trains(base, write_chat_jsonl, tmp_path):
    _train(base, write_chat_jsonl(tmp_path / "d.jsonl", 4), tmp_path / "out", gradient_checkpointing=True)


def test_a_grown_vocabulary_is_padded_to_a_multiple(make_tiny_model, save_model, write_chat_jsonl, tmp_path):
    tok = tokenizer_without_mask()
    base = save_model(make_tiny_model(vocab_size=len(tok), seed=4), tok, tmp_path / "base")
    model = _train(base, write_chat_jsonl(tmp_path / "d.jsonl", 4), tmp_path / "out", vocab_multiple=64)
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows % 64 == 0 and rows > len(tok)


def test_cpu_defaults_and_refusals(monkeypatch, base, tmp_path):
    if not torch.cuda.is_available():
        assert _use_bf16("auto") is False and _attn_implementation("auto") == "sdpa"
        rc, _ = run_cli("train", "mars", "--model", base, "--data", "toy", "-o", tmp_path / "o", "--attention", "flex")
        assert rc == 2
    assert _use_bf16("bf16") is True and _use_bf16("fp32") is False
    with pytest.raises(UserError, match="mask-lr needs frozen embeddings"):
        TrainConfig(stage="mars", model="m", data="toy", output=str(tmp_path / "x"), mask_lr=1e-3).validate()
    with pytest.raises(UserError, match="mask-only"):
        TrainConfig(
            stage="mars", model="m", data="toy", output=str(tmp_path / "x"), mask_only=True, train_layers=2
        ).validate()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match="accelerate launch --num_processes 4"):
        _refuse_data_parallel()
    monkeypatch.setenv("WORLD_SIZE", "4")
    _refuse_data_parallel()


def _distill_file(tokenizer, path, n=4):
    """A `marslm distill` output: answers whose ids are a split the tokenizer would not produce."""
    import json

    from marslm.data.distilled import unfinished_path
    from tests.helpers import chat_conversations

    finished, cut = [], []
    for i, messages in enumerate(chat_conversations(n, seed=3)):
        answer = messages[-1]["content"]
        ids = [t for ch in answer for t in tokenizer.encode(ch, add_special_tokens=False)]  # char by char
        record = {"id": f"p{i}", "source": "chat", "messages": messages, "answer_ids": ids, "finished": i % 2 == 0}
        (finished if record["finished"] else cut).append(json.dumps(record))
    path.write_text("\n".join(finished) + "\n")
    unfinished_path(path).write_text("\n".join(cut) + "\n")
    return path


def test_distilled_answer_ids_are_trained_as_generated(tiny_tokenizer, tiny_model_dir, tmp_path):
    from marslm.chat import IGNORE, encode_prompt, end_of_turn_id, stop_token_ids
    from marslm.training.dataset import encode_dataset, generated_answers

    data = _distill_file(tiny_tokenizer, tmp_path / "d.jsonl")
    stop = stop_token_ids(tiny_tokenizer)
    eos = end_of_turn_id(tiny_tokenizer, stop)

    def examples(**options):
        cfg = TrainConfig(
            stage="mars", model=str(tiny_model_dir), data=str(data), output=str(tmp_path / "o"), **options
        )
        return encode_dataset(tiny_tokenizer, [], 4096, stop, eos, generated_answers(cfg))[0]

    records = [r for r in map(__import__("json").loads, data.read_text().splitlines())]
    first = examples()[0]
    prompt = encode_prompt(tiny_tokenizer, records[0]["messages"][:-1])
    assert first["input_ids"] == prompt + records[0]["answer_ids"] + [eos]
    assert first["labels"] == [IGNORE] * len(prompt) + records[0]["answer_ids"] + [eos]
    assert len(examples()) == 2 and len(examples(cut_answers=True)) == 4
    cut = examples(cut_answers=True)[-1]
    assert cut["labels"][-1] != eos  # a cut answer does not learn to stop
    assert generated_answers(TrainConfig(stage="mars", model="m", data=str(data), output="o", answer_ids=False)) is None


def test_a_tokenised_dataset_is_encoded_once(base, write_chat_jsonl, tmp_path, monkeypatch):
    import marslm.training.recipe as train_module

    monkeypatch.setenv("MARSLM_CACHE", str(tmp_path / "cache"))
    data = write_chat_jsonl(tmp_path / "d.jsonl", 4)
    calls = []
    real = train_module.encode_dataset
    monkeypatch.setattr(train_module, "encode_dataset", lambda *a, **k: calls.append(1) or real(*a, **k))
    _train(base, data, tmp_path / "a")
    _train(base, data, tmp_path / "b")
    assert len(calls) == 1 and len(list((tmp_path / "cache" / "tokenized").glob("*.pt"))) == 1
    _train(base, data, tmp_path / "c", max_length=64)  # another cut: encoded again
    data.write_text(data.read_text().splitlines()[0] + "\n")  # other data: encoded again
    _train(base, data, tmp_path / "d")
    assert len(calls) == 3


def test_auto_attention_falls_back_where_this_torch_has_no_flex(monkeypatch):
    import marslm.training.recipe as train_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _attn_implementation("auto") == "flex_attention"
    monkeypatch.setattr(train_module, "_has_flex_attention", lambda: False)
    assert _attn_implementation("auto") == "sdpa"
    with pytest.raises(UserError, match="torch >= 2.5"):
        _attn_implementation("flex")


def _first_grad_norm(base, data, out, **options) -> float:
    """The gradient norm Trainer logs at the first step, at the starting weights."""
    from transformers import TrainerCallback

    norms = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                norms.append(float(logs["grad_norm"]))

    _train(base, data, out, callbacks=[Record()], logging_steps=1, max_steps=1, **options)
    return norms[0]


def test_soft_clean_anchors_to_the_starting_model_through_the_trainer(base, write_chat_jsonl, tmp_path):
    """--soft-clean 1 on stage ar is a KL to the model training starts from: no gradient at the
    first step, where hard labels on the same data pull. Covers the teacher pass, its cache,
    the collator and the trainer's loss call."""
    data = write_chat_jsonl(tmp_path / "d.jsonl", 6)
    anchored = _first_grad_norm(base, data, tmp_path / "soft", stage="ar", soft_clean=1.0, teacher_top_k=4)
    hard = _first_grad_norm(base, data, tmp_path / "hard", stage="ar")
    again = _first_grad_norm(base, data, tmp_path / "soft2", stage="ar", soft_clean=1.0, teacher_top_k=4)
    assert anchored < 1e-4 < 1e-2 < hard
    assert again == anchored  # the second run read the teacher's cache


@pytest.mark.parametrize(
    "options, share",
    [
        (dict(stage="mars"), 1.0),  # full MARS on the model's own answers: the anchor
        (dict(stage="mars", soft_clean=0.0), 0.0),
        (dict(stage="mars", soft_clean=0.5), 0.5),
        (dict(stage="ar"), 0.0),
        (dict(stage="mars", exact=True), 0.0),
        (dict(stage="mars", mask_only=True), 0.0),
        (dict(stage="mars", data="chat"), 0.0),  # conversations, not the model's answers
    ],
)
def test_the_kl_anchor_is_the_full_modes_default_on_distilled_data(
    options, share, tiny_tokenizer, write_chat_jsonl, tmp_path
):
    data = {"chat": write_chat_jsonl(tmp_path / "chat.jsonl", 2)}.get(
        options.pop("data", None), _distill_file(tiny_tokenizer, tmp_path / "d.jsonl")
    )
    cfg = TrainConfig(model="m", data=str(data), output=str(tmp_path / "o"), **options)
    assert cfg.soft_clean in (None, share)  # given or left to the default
    assert cfg.with_defaults().soft_clean == share


def test_a_full_run_on_distilled_data_anchors_through_the_teacher(tiny_tokenizer, base, tmp_path, monkeypatch):
    """The default reaches training: the teacher pass runs, and the run's settings record the share,
    so a resumed run compares definite values."""
    import json

    from marslm.training import teacher

    calls = []
    real = teacher.teacher_top_k
    monkeypatch.setattr(teacher, "teacher_top_k", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = _distill_file(tiny_tokenizer, tmp_path / "d.jsonl")
    _train(base, data, tmp_path / "o", max_steps=1, teacher_top_k=4)
    assert calls == [1]
    settings = json.loads((tmp_path / "o" / "marslm.json").read_text())
    assert settings["extra"]["settings"]["soft_clean"] == 1.0


def test_soft_target_and_optimizer_settings_are_checked(base, write_chat_jsonl, tmp_path):
    with pytest.raises(UserError, match="--soft-masked"):
        TrainConfig(stage="ar", model=str(base), data="toy", output=str(tmp_path / "o"), soft_masked=0.5).validate()
    with pytest.raises(UserError, match="--soft-clean"):
        TrainConfig(stage="mars", model=str(base), data="toy", output=str(tmp_path / "o"), soft_clean=1.5).validate()
    with pytest.raises(UserError, match="--adam-epsilon"):
        TrainConfig(stage="mars", model=str(base), data="toy", output=str(tmp_path / "o"), adam_epsilon=0).validate()
