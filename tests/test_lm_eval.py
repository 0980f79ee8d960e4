"""The lm-evaluation-harness adapter: in-process checks of each request type, and one end-to-end
``python -m marslm.eval.lm_eval_adapter`` run (a subprocess, offline) on the packaged toy-suite task,
exactly as the README writes it (no data file, no --include_path), whose accuracy and
tokens/forward must equal ``evaluate()`` on the same items.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'marslm[eval]')")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from marslm.chat import encode_prompt  # noqa: E402
from marslm.data import toy  # noqa: E402
from marslm.decode import PAPER_RULE  # noqa: E402
from marslm.errors import UserError  # noqa: E402
from marslm.eval.evaluate import evaluate  # noqa: E402
from marslm.eval.lm_eval_adapter import MarsLM, _fallback  # noqa: E402
from marslm.eval.sets import EvalSet  # noqa: E402
from tests.trained import TRAIN_N  # noqa: E402

N_ITEMS = 16
SETTINGS = dict(tau=0.9, block_size=4, max_new_tokens=128)


def request(kind: str, args: tuple, idx: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


@pytest.fixture(scope="module")
def lm(trained_dirs) -> MarsLM:
    return get_model("marslm")(
        pretrained=str(trained_dirs["dir"] / "mars"), tau=0.9, block_size=4, batch_size=4, device="cpu"
    )


def test_registered_and_chat_template(lm):
    assert get_model("marslm") is MarsLM
    messages = [{"role": "user", "content": "Sort this list: [3, 1, 2]"}]
    context = lm.apply_chat_template(messages)
    assert lm.tok_encode(context) == encode_prompt(lm.tokenizer, messages)
    assert lm.tokenizer_name and lm.chat_template(True) == lm.tokenizer.chat_template


def test_loglikelihood_is_the_plain_ar_forward(lm):
    context, continuation = "Sort this list: [3, 1, 2]\nAnswer:", " [1, 2, 3]"
    [(logprob, greedy)] = lm.loglikelihood([request("loglikelihood", (context, continuation))])
    ctx, whole = lm.tok_encode(context), lm.tok_encode(context + continuation)
    with torch.no_grad():
        logits = lm.model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    expected = sum(float(logits[t - 1, whole[t]]) for t in range(len(ctx), len(whole)))
    assert logprob == pytest.approx(expected, abs=1e-4) and isinstance(greedy, bool)

    text = "The answer is 7. " * 3
    [rolling] = lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])
    ids = [lm.prefix_token_id] + lm.tok_encode(text)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert rolling == pytest.approx(sum(float(logits[t - 1, ids[t]]) for t in range(1, len(ids))), abs=1e-3)


def test_generate_until_cuts_at_stop_strings(lm):
    prompt = toy.make_split("train", TRAIN_N, seed=0)[0].messages
    context = lm.apply_chat_template(prompt)
    free, cut = lm.generate_until(
        [
            request("generate_until", (context, {"until": ["<|im_end|>"], "max_gen_toks": 64}), 0),
            request("generate_until", (context, {"until": ["\n"], "max_gen_toks": 64}), 1),
        ]
    )
    assert "\n" in free and cut == free.split("\n")[0]
    info = lm.get_model_info()["marslm"]
    assert info["answers"] == 2 and info["tokens_per_forward"] >= 1 and info["tau"] == 0.9


def test_lm_eval_cli_matches_evaluate(trained_dirs, tmp_path):
    mars = trained_dirs["dir"] / "mars"
    examples = toy.make_split("train", N_ITEMS, seed=0)  # memorised: accuracy well above 0
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"),
        TOKENIZERS_PARALLELISM="false",
    )
    model_args = f"pretrained={mars},tau={SETTINGS['tau']},block_size={SETTINGS['block_size']},cache=cursor"
    model_args += ",adaptive_width=False,mask_batch_limit=off"  # the paper's rule: text independent of timing
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "marslm.eval.lm_eval_adapter",
            "--model",
            "marslm",
            "--model_args",
            model_args,
            "--tasks",
            "marslm_toy",
            "--metadata",
            json.dumps({"split": "train", "n": N_ITEMS, "seed": 0}),
            "--apply_chat_template",
            "--gen_kwargs",
            f"max_gen_toks={SETTINGS['max_new_tokens']}",
            "--batch_size",
            str(N_ITEMS),
            "--device",
            "cpu",
            "--output_path",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    accuracy = results["results"]["marslm_toy"]["acc,none"]
    stats = results["config"]["marslm"]

    from marslm.modeling import load_model

    model, tokenizer, _ = load_model(str(mars))
    reference = evaluate(
        model,
        tokenizer,
        EvalSet("toy-train", examples, toy.score_many),
        taus=(SETTINGS["tau"],),
        block_size=SETTINGS["block_size"],
        max_new_tokens=SETTINGS["max_new_tokens"],
        batch_size=N_ITEMS,
        progress=False,
        **PAPER_RULE,
    )["results"][0]
    assert accuracy == pytest.approx(reference["accuracy"]) and reference["accuracy"] > 0.25
    assert stats["tokens_per_forward"] == pytest.approx(reference["tokens_per_forward"])
    assert stats["answers"] == N_ITEMS and stats["block_size"] == SETTINGS["block_size"]


def test_the_fallback_model_args_reach_the_decoder_settings():
    assert _fallback(None, None) == {}  # the decoder's default
    assert _fallback("False", "off") == PAPER_RULE
    assert _fallback(True, 3) == {"adaptive_width": True, "mask_batch_limit": 3}  # lm-eval's own guesses
    assert _fallback("true", "auto") == {"adaptive_width": True, "mask_batch_limit": "auto"}
    with pytest.raises(UserError, match="adaptive_width must be True or False"):
        _fallback("maybe", None)
    from marslm.decode import DecoderOptions

    with pytest.raises(UserError, match="mask_batch_limit must be"):
        DecoderOptions(**_fallback(None, "-2"))
