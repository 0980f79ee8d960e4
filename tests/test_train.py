"""End to end: `marslm train ar|mars` and `marslm generate`, bad input, resuming, distributed.

Everything runs on tiny random models and a few examples, so each training run takes seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marslm import cli
from marslm.chat import encode_conversation
from marslm.mars_json import MarsConfig
from marslm.modeling import count_parameters
from marslm.training.surgery import ensure_mask_token
from tests.helpers import chat_conversations

MASK = "<|mask|>"
BIN = Path(sys.executable).parent


def run_cli(*args) -> tuple[int, str]:
    """``marslm ARGS`` in-process; returns (exit status, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main([str(a) for a in args])
    return rc, out.getvalue()


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def marslm_cmd(console_script: bool = False) -> list[str]:
    if console_script:
        script = BIN / "marslm"
        if not script.exists():
            pytest.skip("no marslm console script next to the interpreter")
        return [str(script)]
    return [sys.executable, "-m", "marslm.cli"]


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*.partial")) + sorted(p.name for p in root.rglob("*.old"))


TRAIN_FLAGS = ["--max-steps", 6, "--batch-size", 4, "--lr", 1e-3, "--logging-steps", 2, "--quiet"]


# ------------------------------------------------------------------ ar -> mars through the CLI


@pytest.fixture(scope="module")
def trained(tiny_model_dir, write_chat_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    data = write_chat_jsonl(root / "data.jsonl", 12)
    ar, mars = root / "ar", root / "mars"
    rc_ar, out_ar = run_cli("train", "ar", "--model", tiny_model_dir, "--data", data, "-o", ar, *TRAIN_FLAGS)
    rc_mars, out_mars = run_cli(
        "train", "mars", "--model", ar, "--data", data, "-o", mars, "--block-size", 4, *TRAIN_FLAGS
    )
    return dict(
        root=root, data=data, base=tiny_model_dir, ar=ar, mars=mars, rc=(rc_ar, rc_mars), out=(out_ar, out_mars)
    )


def test_train_ar_then_mars_exit_zero_and_summary(trained):
    assert trained["rc"] == (0, 0)
    out_ar, out_mars = trained["out"]
    assert out_ar.strip().splitlines()[-1].startswith(f"trained ar -> {trained['ar']}: 12 examples (0 truncated")
    assert out_mars.strip().splitlines()[-1].startswith(f"trained mars -> {trained['mars']}: 12 examples")
    assert "6 steps" in out_mars


@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_outputs_are_plain_hf_dirs_with_marslm_json(trained, stage):
    out = trained[stage]
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "marslm.json",
        "training_log.json",
    ):
        assert (out / name).is_file(), name
    cfg = MarsConfig.load(out)
    raw = json.loads((out / "marslm.json").read_text())
    assert {"stage", "block_size", "mask_token_id"} <= raw.keys()
    assert cfg.stage == stage
    assert cfg.block_size == (4 if stage == "mars" else 1)
    assert cfg.mask_token_id == 3  # the tokenizer already has <|mask|> at id 3
    assert cfg.extra["train"]["steps"] == 6
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    assert leftovers(trained["root"]) == []


@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_checkpoint_keeps_parameter_count_and_loads_with_plain_transformers(trained, stage):
    base, _ = load(trained["base" if stage == "ar" else "ar"])  # the stage's input checkpoint
    model, tokenizer = load(trained[stage])
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert count_parameters(model) == count_parameters(base)
    assert model.get_input_embeddings().weight.shape == base.get_input_embeddings().weight.shape
    assert MarsConfig.load(trained[stage]).extra["train"]["parameters"] == count_parameters(base)
    assert tokenizer.convert_tokens_to_ids(MASK) == 3 and len(tokenizer) < model.config.vocab_size
    # training moved the weights
    base_sd = base.state_dict()
    assert any(not torch.equal(v, base_sd[k]) for k, v in model.state_dict().items())
    # and it still runs as the plain AR model
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 plus 4?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    assert prompt_len < out.shape[1] <= prompt_len + 5


def test_generate_json_subprocess(trained):
    proc = subprocess.run(
        marslm_cmd(console_script=True)
        + [
            "generate",
            "--model",
            str(trained["mars"]),
            "--prompt",
            "What is 3 plus 4?",
            "--json",
            "--max-new-tokens",
            "12",
            "--tau",
            "0.5",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {"text", "tokens", "forwards", "tokens_per_forward", "accepted_per_step", "settings"}
    assert result["settings"]["tau"] == 0.5 and result["settings"]["dtype"] == "float32"
    assert isinstance(result["text"], str)
    assert 1 <= result["tokens"] <= 12
    assert len(result["accepted_per_step"]) == result["forwards"] >= 1
    assert all(a >= 1 for a in result["accepted_per_step"])
    accepted = sum(result["accepted_per_step"])
    assert result["tokens"] <= accepted <= result["tokens"] + 1  # + the stop token, if any
    assert result["tokens_per_forward"] == pytest.approx(accepted / result["forwards"], abs=1e-4)


def test_generate_cli_stop_strings_and_seeded_sampling(trained):
    base = ["generate", "--model", trained["mars"], "--prompt", "What is 3 plus 4?", "--json", "--max-new-tokens", 24]
    rc, out = run_cli(*base, "--tau", 1.0)
    full = json.loads(out)["text"]
    assert rc == 0 and len(full) > 4
    stop = full[2:4]
    rc, out = run_cli(*base, "--tau", 1.0, "--stop", stop, "--stop", "never in there")
    assert rc == 0 and json.loads(out)["text"] == full[: full.find(stop)]
    # a seed repeats a lossless sample under the default auto limit, whose decisions follow each
    # process's timings: a sample does not depend on which steps draft (draws.py)
    seeded = ("--mode", "lossless", "--temperature", 1.0, "--seed", 3)
    sampled = [run_cli(*base, *seeded)[1] for _ in range(2)]
    assert json.loads(sampled[0])["text"] == json.loads(sampled[1])["text"]


# ------------------------------------------------------------------ the mask token


def tokenizer_without_mask():
    """A Qwen2Tokenizer with only <|endoftext|>, <|im_start|>, <|im_end|> (no <|mask|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from marslm.data.tokenizer import CHAT_TEMPLATE
    from tests.helpers import corpus_texts as _corpus_texts

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=2,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_corpus_texts(), trainer=trainer)
    learned = json.loads(backend.to_str())["model"]
    tok = Qwen2Tokenizer(
        vocab=learned["vocab"],
        merges=[tuple(m) for m in learned["merges"]],
        bos_token=None,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=specials[1:],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    assert MASK not in tok.get_vocab() and len(tok) % 64 != 0
    return tok


def test_ensure_mask_token_uses_a_spare_row(make_tiny_model):
    tok = tokenizer_without_mask()
    model = make_tiny_model(vocab_size=-(-len(tok) // 64) * 64)
    before, rows = count_parameters(model), model.get_input_embeddings().weight.shape[0]
    n = len(tok)
    mask_id = ensure_mask_token(model, tok)
    assert mask_id == n < rows
    assert tok.convert_tokens_to_ids(MASK) == mask_id and len(tok) == n + 1
    assert tok.encode(f"a{MASK}b", add_special_tokens=False).count(mask_id) == 1
    assert count_parameters(model) == before
    assert model.get_input_embeddings().weight.shape[0] == rows
    # idempotent
    assert ensure_mask_token(model, tok) == mask_id and len(tok) == n + 1


def test_ensure_mask_token_adds_exactly_one_row_when_none_is_spare(make_tiny_model):
    tok = tokenizer_without_mask()
    model = make_tiny_model(vocab_size=len(tok))
    before, hidden = count_parameters(model), model.config.hidden_size
    mask_id = ensure_mask_token(model, tok)
    assert mask_id == len(tok) - 1
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    assert count_parameters(model) == before + hidden  # tied embeddings: one row of hidden_size
    assert model(input_ids=torch.tensor([[mask_id]])).logits.shape[-1] == len(tok)


def test_ensure_mask_token_keeps_an_existing_mask(tiny_tokenizer, make_tiny_model):
    model = make_tiny_model()
    n, before = len(tiny_tokenizer), count_parameters(model)
    assert ensure_mask_token(model, tiny_tokenizer) == 3
    assert len(tiny_tokenizer) == n and count_parameters(model) == before


def test_train_mars_adds_mask_token_on_a_spare_row(make_tiny_model, save_model, write_chat_jsonl, tmp_path):
    tok = tokenizer_without_mask()
    base = save_model(make_tiny_model(vocab_size=-(-len(tok) // 64) * 64, seed=4), tok, tmp_path / "base")
    data = write_chat_jsonl(tmp_path / "data.jsonl", 4)
    rc, _ = run_cli(
        "train",
        "mars",
        "--model",
        base,
        "--data",
        data,
        "-o",
        tmp_path / "out",
        "--max-steps",
        2,
        "--batch-size",
        2,
        "--quiet",
    )
    assert rc == 0
    model, saved_tok = load(tmp_path / "out")
    assert count_parameters(model) == count_parameters(load(base)[0])
    assert saved_tok.convert_tokens_to_ids(MASK) == len(tok) == MarsConfig.load(tmp_path / "out").mask_token_id


# ------------------------------------------------------------------ bad input


def bad_cases(root: Path, model_dir: Path) -> dict:
    """name -> (argv after `marslm`, output dir that must not appear, expected text in the message)."""
    good = root / "good.jsonl"
    lines = [json.dumps({"messages": m}) for m in chat_conversations(3)]
    good.write_text("\n".join(lines) + "\n")
    (root / "empty.jsonl").write_text("")
    (root / "malformed.jsonl").write_text(lines[0] + "\n" + lines[1] + '\n{"messages": [oops\n')
    (root / "no_assistant.jsonl").write_text(
        lines[0] + "\n" + json.dumps({"messages": [{"role": "user", "content": "What is 1 plus 1?"}]}) + "\n"
    )
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "weights.bin").write_text("x")
    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")

    def train(name, model=model_dir, data=good, extra=()):
        out = root / f"out_{name}"
        return [
            "train",
            "mars",
            "--model",
            str(model),
            "--data",
            str(data),
            "-o",
            str(out),
            "--max-steps",
            "2",
            *extra,
        ], out

    def generate(*extra):
        return ["generate", "--model", str(model_dir), "--prompt", "hi", *extra], None

    return {
        "missing_model": (*train("missing_model", model=root / "no_such_model"), "not found"),
        "no_config_json": (*train("no_config_json", model=root / "not_a_model"), "config.json"),
        "missing_data": (*train("missing_data", data=root / "no_such.jsonl"), "no_such.jsonl"),
        "empty_jsonl": (*train("empty_jsonl", data=root / "empty.jsonl"), "empty"),
        "malformed_jsonl": (*train("malformed_jsonl", data=root / "malformed.jsonl"), "malformed.jsonl:3:"),
        "no_assistant_turn": (*train("no_assistant_turn", data=root / "no_assistant.jsonl"), "assistant"),
        "block_size_0": (*train("block_size_0", extra=["--block-size", "0"]), "--block-size"),
        "data_mix_on_a_file": (*train("data_mix_on_a_file", extra=["--data-mix", "lists=2"]), "toy only"),
        "data_mix_unknown_family": (
            *train("data_mix_unknown_family", data="toy", extra=["--data-mix", "list=2"]),
            "unknown families",
        ),
        "data_mix_not_a_pair": (
            *train("data_mix_not_a_pair", data="toy", extra=["--data-mix", "lists"]),
            "FAMILY=WEIGHT",
        ),
        "output_taken": (
            ["train", "mars", "--model", str(model_dir), "--data", str(good), "-o", str(root / "taken")],
            None,
            "--overwrite",
        ),
        "tau_0": (*generate("--tau", "0"), "tau"),
        "tau_1.5": (*generate("--tau", "1.5"), "tau"),
        "entropy_tau_-1": (*generate("--metric", "entropy", "--tau", "-1"), "tau"),
        "generate_missing_model": (
            ["generate", "--model", str(root / "no_such_model"), "--prompt", "hi"],
            None,
            "not found",
        ),
    }


@pytest.fixture(scope="module")
def bad_runs(tiny_model_dir, tmp_path_factory):
    """Run every bad-input case as its own `marslm` process, a few at a time."""
    root = tmp_path_factory.mktemp("bad")
    cases = bad_cases(root, tiny_model_dir)
    results = {}
    names = list(cases)
    for start in range(0, len(names), 4):
        procs = {}
        for i, name in enumerate(names[start : start + 4]):
            argv, _, _ = cases[name]
            procs[name] = subprocess.Popen(
                marslm_cmd(console_script=(i == 0 and (BIN / "marslm").exists())) + argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=subprocess_env(),
                cwd=root,
            )
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            results[name] = (proc.returncode, stdout, stderr)
    return root, cases, results


BAD_CASES = [
    "missing_model",
    "no_config_json",
    "missing_data",
    "empty_jsonl",
    "malformed_jsonl",
    "no_assistant_turn",
    "block_size_0",
    "data_mix_on_a_file",
    "data_mix_unknown_family",
    "data_mix_not_a_pair",
    "output_taken",
    "tau_0",
    "tau_1.5",
    "entropy_tau_-1",
    "generate_missing_model",
]


@pytest.mark.parametrize("name", BAD_CASES)
def test_bad_input_exits_2_with_one_line(bad_runs, name):
    root, cases, results = bad_runs
    assert set(cases) == set(BAD_CASES)
    _, out_dir, expected = cases[name]
    rc, stdout, stderr = results[name]
    lines = stderr.strip().splitlines()
    assert rc == 2, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("marslm")
    assert "error" in lines[0] and expected in lines[0], lines[0]
    assert "Traceback" not in stderr
    assert stdout == ""
    if out_dir is not None:
        assert not out_dir.exists()
    assert leftovers(root) == []
    assert (root / "taken").is_dir() and [p.name for p in (root / "taken").iterdir()] == ["keep.txt"]
    assert (root / "taken" / "keep.txt").read_text() == "mine"


def test_no_trainable_examples_is_a_user_error(tiny_model_dir, write_chat_jsonl, tmp_path, capsys):
    data = write_chat_jsonl(tmp_path / "data.jsonl", 3)
    rc, _ = run_cli(
        "train",
        "ar",
        "--model",
        tiny_model_dir,
        "--data",
        data,
        "-o",
        tmp_path / "out",
        "--max-length",
        5,
        "--max-steps",
        1,
        "--quiet",
    )
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("marslm train: error:") and "max-length" in err[-1]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ------------------------------------------------------------------ truncation


def test_truncation_is_counted_in_the_summary(tiny_tokenizer, tiny_model_dir, write_chat_jsonl, tmp_path):
    data = write_chat_jsonl(tmp_path / "data.jsonl", 12, seed=7)
    lengths = sorted(len(encode_conversation(tiny_tokenizer, m).input_ids) for m in chat_conversations(12, seed=7))
    max_length = lengths[len(lengths) // 2]
    expected = sum(n > max_length for n in lengths)
    assert 0 < expected < 12
    rc, out = run_cli(
        "train",
        "ar",
        "--model",
        tiny_model_dir,
        "--data",
        data,
        "-o",
        tmp_path / "out",
        "--max-length",
        max_length,
        "--max-steps",
        2,
        "--batch-size",
        4,
        "--quiet",
    )
    assert rc == 0
    assert f"12 examples ({expected} truncated, 0 dropped)" in out
    assert MarsConfig.load(tmp_path / "out").extra["train"]["truncated"] == expected


# ------------------------------------------------------------------ resume


def interrupt_at(step: int):
    """A callback that raises KeyboardInterrupt at the end of ``step`` (after earlier checkpoints)."""
    from transformers import TrainerCallback

    class _Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise KeyboardInterrupt

    return _Interrupt()


def step_recorder():
    """A callback that records the global step at the start of every optimizer step."""
    from transformers import TrainerCallback

    class _Record(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    return _Record()


def test_interrupted_training_resumes(tiny_model_dir, write_chat_jsonl, tmp_path):
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    data = write_chat_jsonl(tmp_path / "data.jsonl", 8)
    out = tmp_path / "out"

    def config():
        return TrainConfig(
            stage="mars",
            model=str(tiny_model_dir),
            data=str(data),
            output=str(out),
            block_size=4,
            max_steps=6,
            save_steps=2,
            batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            progress=False,
        )

    first = step_recorder()
    with pytest.raises(KeyboardInterrupt):
        train(config(), callbacks=[first, interrupt_at(3)])
    assert first.steps == [0, 1, 2]
    partial = tmp_path / "out.partial"
    assert not out.exists()
    assert (partial / "checkpoint-2").is_dir()
    assert not (partial / "checkpoint-4").exists()

    second = step_recorder()
    summary = train(config(), callbacks=[second])
    assert second.steps[0] == 2 and second.steps[-1] == 5  # resumed after checkpoint-2, not from 0
    assert summary.steps == 6
    assert out.is_dir() and not partial.exists()
    log = json.loads((out / "training_log.json").read_text())
    assert log[-1]["step"] == 6
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert MarsConfig.load(out).extra["train"]["steps"] == 6


def test_no_resume_starts_over(tiny_model_dir, write_chat_jsonl, tmp_path):
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    data = write_chat_jsonl(tmp_path / "data.jsonl", 4)
    out = tmp_path / "out"
    cfg = dict(
        stage="ar",
        model=str(tiny_model_dir),
        data=str(data),
        output=str(out),
        max_steps=4,
        save_steps=1,
        batch_size=2,
        progress=False,
    )
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**cfg), callbacks=[interrupt_at(2)])
    assert (tmp_path / "out.partial" / "checkpoint-1").is_dir()
    rec = step_recorder()
    train(TrainConfig(**cfg, resume=False), callbacks=[rec])
    assert rec.steps == [0, 1, 2, 3]
    assert out.is_dir() and not (tmp_path / "out.partial").exists()


# ------------------------------------------------------------------ distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_loss(out: Path) -> float:
    log = json.loads((out / "training_log.json").read_text())
    return float(log[-1]["train_loss"])


@pytest.mark.slow
def test_accelerate_launch_two_processes_matches_one(trained, tmp_path):
    accelerate = BIN / "accelerate"
    if not accelerate.exists():
        pytest.skip("accelerate CLI not installed next to the interpreter")
    data = trained["data"]  # 12 examples
    common = [
        "train",
        "mars",
        "--model",
        str(trained["ar"]),
        "--data",
        str(data),
        "--epochs",
        "1",
        "--lr",
        "1e-9",
        "--logging-steps",
        "1",
        "--quiet",
        "--block-size",
        "4",
    ]
    # `accelerate launch --cpu --num_processes 2` starts ONE process (it would need mpirun);
    # the torchrun-based launcher with the CPU forced is what gives two gloo ranks.
    dist_out = tmp_path / "dist"
    proc = subprocess.run(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            "-m",
            "marslm.cli",
            *common,
            "-o",
            str(dist_out),
            "--batch-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=subprocess_env(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # both ranks ran: 12 examples / (2 processes x 2) = 3 optimizer steps
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("trained mars")]
    assert len(summaries) == 2, proc.stdout
    assert all("3 steps" in line for line in summaries)
    assert MarsConfig.load(dist_out).extra["train"]["steps"] == 3
    assert leftovers(tmp_path) == []
    model, _ = load(dist_out)
    assert count_parameters(model) == count_parameters(load(trained["ar"])[0])

    single_out = tmp_path / "single"
    rc, out = run_cli(*common, "-o", single_out, "--batch-size", 4)
    assert rc == 0 and "3 steps" in out
    dist_loss, single_loss = train_loss(dist_out), train_loss(single_out)
    assert dist_loss == pytest.approx(single_loss, rel=0.05)


def test_lr_schedule_reaches_the_trainer(tiny_model_dir, write_chat_jsonl, tmp_path):
    from marslm.errors import UserError
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    data = write_chat_jsonl(tmp_path / "data.jsonl", 8)
    cfg = dict(
        stage="ar",
        model=str(tiny_model_dir),
        data=str(data),
        max_steps=6,
        batch_size=2,
        learning_rate=1e-3,
        warmup_ratio=0.0,
        logging_steps=1,
        progress=False,
    )
    with pytest.raises(UserError, match="lr-schedule"):
        TrainConfig(**cfg, output=str(tmp_path / "bad"), lr_schedule="cosine_with_min_lr").validate()

    rates = {}
    for schedule in ("constant_with_warmup", "cosine"):
        out = tmp_path / schedule
        train(TrainConfig(**cfg, output=str(out), lr_schedule=schedule))
        log = json.loads((out / "training_log.json").read_text())
        rates[schedule] = [e["learning_rate"] for e in log if "learning_rate" in e]
    assert rates["constant_with_warmup"] == [1e-3] * 6
    cosine = rates["cosine"]
    assert len(cosine) == 6 and all(a > b for a, b in zip(cosine, cosine[1:])) and cosine[-1] < cosine[0] / 2


def test_data_mix_skews_the_toy_training_mixture(tiny_model_dir, tmp_path):
    from marslm.data import load_conversations, toy
    from marslm.errors import UserError
    from marslm.training.config import TrainConfig

    conversations = load_conversations("toy", n=40, mix={"lists": 3})
    examples = toy.make_split("train", 40, weights={"lists": 3})
    assert conversations == [toy.to_chat_record(ex)["messages"] for ex in examples]
    assert sum(ex.family == "lists" for ex in examples) == 20  # 3 / (1 + 1 + 1 + 3) of 40
    cfg = dict(stage="ar", model=str(tiny_model_dir), output=str(tmp_path / "out"), max_steps=1)
    with pytest.raises(UserError, match="applies to --data toy only"):
        TrainConfig(**cfg, data=str(tmp_path / "chat.jsonl"), data_mix={"lists": 2}).validate()
    with pytest.raises(UserError, match="unknown families"):
        TrainConfig(**cfg, data="toy", data_mix={"list": 2}).validate()


# ------------------------------------------------------------------ gradient accumulation


class GradientRecorder:
    """Keeps the gradients of the first optimizer step (taken before the optimizer moves anything)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Record(TrainerCallback):
            grads: dict = {}

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if not self.grads:
                    self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        return _Record()


@pytest.mark.parametrize("normalization", ["sequence", "token"])
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_gradient_accumulation_changes_neither_loss_nor_gradients(
    tiny_tokenizer, make_tiny_model, tmp_path, stage, packing, normalization
):
    """4 examples as 4x1, 2x2 and 1x4 (batch x accumulation): one optimizer step each, the same
    logged loss and the same gradients, to float tolerance."""
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    runs = {}
    for batch_size, accumulate in ((4, 1), (2, 2), (1, 4)):
        recorder = GradientRecorder()
        out = tmp_path / f"{batch_size}x{accumulate}"
        cfg = TrainConfig(
            stage=stage,
            model="tiny",
            data="toy",
            data_n=4,
            output=str(out),
            block_size=4,
            max_steps=1,
            batch_size=batch_size,
            grad_accum=accumulate,
            learning_rate=1e-3,
            max_grad_norm=0.0,
            logging_steps=1,
            save_steps=10**9,
            packing=packing,
            loss_normalization=normalization,
            progress=False,
        )
        model = make_tiny_model(seed=8)
        tokenizer = __import__("copy").deepcopy(tiny_tokenizer)
        train(cfg, callbacks=[recorder], model=model, tokenizer=tokenizer)
        log = json.loads((out / "training_log.json").read_text())
        runs[(batch_size, accumulate)] = ([e for e in log if "loss" in e][0], recorder.grads)
    (first_log, first_grads), *others = runs.values()
    assert first_grads
    for log, grads in others:
        assert log["loss"] == pytest.approx(first_log["loss"], rel=1e-4)
        for term in ("clean_loss", "noisy_loss"):
            if term in first_log:
                assert log[term] == pytest.approx(first_log[term], rel=1e-3)
        for name, grad in first_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)


def test_block_padding_repeats_the_end_of_turn_token_not_the_first_stop_id(tiny_tokenizer, make_tiny_model, tmp_path):
    """A generation config that lists another stop id first (as Llama-3-Instruct does) must not
    change what the answers are padded with: the token the assistant turn ends with, trained on."""
    from marslm.chat import end_of_turn_id, stop_token_ids
    from marslm.training.config import TrainConfig
    from marslm.training.recipe import train

    end_of_text, im_end = tiny_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    model = make_tiny_model(seed=2)
    model.generation_config.eos_token_id = [end_of_text, im_end]
    stop_ids = stop_token_ids(tiny_tokenizer, model.generation_config)
    assert stop_ids[0] == end_of_text
    assert end_of_turn_id(tiny_tokenizer, stop_ids) == im_end

    seen = []
    model.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chat_conversations(4, seed=2)))
    cfg = TrainConfig(
        stage="mars",
        model="tiny",
        data=str(data),
        output=str(tmp_path / "out"),
        block_size=8,
        max_steps=1,
        batch_size=4,
        logging_steps=1,
        save_steps=10**9,
        progress=False,
    )
    train(cfg, model=model, tokenizer=tiny_tokenizer)
    for conversation in chat_conversations(4, seed=2):
        ids = encode_conversation(tiny_tokenizer, conversation).input_ids
        row = next(r for r in seen[0].tolist() if r[: len(ids)] == ids)
        padding = row[len(ids) : len(ids) + (-len(ids) % 8)]
        assert padding and set(padding) == {im_end}
