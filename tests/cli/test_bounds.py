"""Every number is bounded by what it means (the model's context, a sane count), and an input
longer than the model's context is refused as the server refuses it: one line, exit 2, before any
model loads where the bound is known without it, never a hang, a huge allocation or empty text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from marslm.mars_json import MarsConfig
from tests.cli.test_errors import assert_one_line_error, run

HUGE = str(2**70)
NOWHERE = "http://127.0.0.1:9"  # nothing listens: a loadtest that got as far as sending would say so


@pytest.fixture(scope="module")
def mars_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny random model as a MARS checkpoint (its marslm.json: B = 4, the <|mask|> token),
    so loading it warns about nothing; its context is 1,024 positions."""
    path = tmp_path_factory.mktemp("bounds") / "mars"
    shutil.copytree(tiny_model_dir, path)
    MarsConfig(stage="mars", block_size=4).save(path)
    return path


@pytest.fixture
def no_model_loads(monkeypatch):
    from marslm import modeling

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(modeling, "load_model", refuse)


def long_text(words: int) -> str:
    return " ".join(str(i % 97) for i in range(words))


def _case(args: list[str], fragment: str):
    """A parameter named by its command and flags (``eval --n``), so a run can pick it."""
    return pytest.param(args, fragment, id=" ".join(a for a in args if a.startswith("--") or a == args[0]))


@pytest.mark.parametrize(
    "args, fragment",
    [
        _case(["generate", "--prompt", "hi", "--max-new-tokens", HUGE], "max_new_tokens must be at most 1023"),
        _case(["generate", "--prompt", "hi", "--max-new-tokens", "5000"], "the model's context of 1024 tokens"),
        _case(["show", "--prompt", "hi", "--max-new-tokens", HUGE], "max_new_tokens must be at most 1023"),
        _case(
            ["generate", "--prompt", "hi", "--cache", "block", "--tau", "1", "--block-cache-size", HUGE],
            "block_cache_size must be at most the model's context of 1024 tokens",
        ),
        _case(["eval", "--max-new-tokens", HUGE, "--n", "2", "--quiet"], "max_new_tokens must be at most 1023"),
        _case(["eval", "--n", HUGE, "--quiet"], "--n must be in 1..1000000"),
        _case(["eval", "--n", "2", "--batch-size", HUGE, "--quiet"], "--batch-size must be in 1..1000000"),
        _case(["bench", "--ar-model", "{model}", "--max-new-tokens", HUGE], "max_new_tokens must be at most 1023"),
        _case(["bench", "--ar-model", "{model}", "--n", HUGE], "--n must be in 1..1000000"),
        _case(["bench", "--ar-model", "{model}", "--batch-sizes", f"1,{HUGE}"], "--batch-sizes must be in 1..1000000"),
        _case(["bench", "--cost-curve", "--batch-sizes", HUGE], "--batch-sizes must be in 1..1000000"),
        _case(["bench", "--cost-curve", "--block-size", HUGE], "--block-size must be in 1..1000000"),
        _case(["bench", "--cost-curve", "--block-size", "600"], "2 --block-size + 2) exceeds the model's context"),
    ],
)
def test_numbers_past_their_meaning_are_refused_before_loading(mars_dir, capsys, no_model_loads, args, fragment):
    args = [a.replace("{model}", str(mars_dir)) for a in args]
    rc, out, err = run(capsys, args[0], "--model", mars_dir, *args[1:])
    assert_one_line_error(rc, err, fragment)
    assert out == ""


def test_loadtest_bounds_requests_before_building_its_split_or_sending(capsys, monkeypatch):
    from marslm.data import toy

    def no_split(*args, **kwargs):
        raise AssertionError("the split was built before --requests was checked")

    monkeypatch.setattr(toy, "make_split", no_split)
    rc, _, err = run(capsys, "loadtest", "--url", NOWHERE, "--requests", HUGE)
    assert_one_line_error(rc, err, "--requests must be in 1..1000000")
    rc, _, err = run(capsys, "loadtest", "--url", NOWHERE, "--concurrency", f"1,{HUGE}")
    assert_one_line_error(rc, err, "--concurrency must be in 1..1000000")


def test_generate_refuses_a_prompt_longer_than_the_context(mars_dir, capsys):
    rc, out, err = run(capsys, "generate", "--model", mars_dir, "--prompt", long_text(3000), "--max-new-tokens", 4)
    assert_one_line_error(rc, err, "tokens; the model's context is 1024")
    assert out == ""


def test_generate_refuses_a_prompt_and_answer_past_the_context(mars_dir, capsys):
    rc, _, err = run(capsys, "generate", "--model", mars_dir, "--prompt", long_text(100), "--max-new-tokens", 1000)
    assert_one_line_error(rc, err, "plus max_new_tokens (1000) exceeds the model's context of 1024 tokens")


def test_eval_refuses_a_question_longer_than_the_context(mars_dir, capsys, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": long_text(3000), "answer": "#### 1"}) + "\n")
    report = tmp_path / "report.json"
    rc, _, err = run(capsys, "eval", "--model", mars_dir, "--data", f"gsm8k:{data}", "--tau", "1", "--n", 1, "--quiet")
    assert_one_line_error(rc, err, "tokens; the model's context is 1024")
    assert not report.exists()


def test_probe_refuses_an_answer_longer_than_the_context(mars_dir, capsys, tmp_path):
    data = tmp_path / "held-out.jsonl"
    short = {"messages": [{"role": "user", "content": "1 plus 1?"}, {"role": "assistant", "content": "2"}]}
    long = {"messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": long_text(3000)}]}
    data.write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n")
    rc, out, err = run(capsys, "probe", "--model", mars_dir, "--data", data, "--json")
    assert_one_line_error(rc, err, "held-out.jsonl:2: the prompt and answer have", "the model's context is 1024")
    assert out == ""


def test_the_library_bounds_what_the_cli_bounds(mars_dir):
    from marslm import load
    from marslm.decode import generate
    from marslm.errors import UserError

    model, tokenizer = load(str(mars_dir))[:2]
    with pytest.raises(UserError, match="max_new_tokens must be at most 1023"):
        generate(model, tokenizer, ["hi"], max_new_tokens=2**70)
    with pytest.raises(UserError, match="block_cache_size must be at most"):
        generate(model, tokenizer, ["hi"], max_new_tokens=4, cache="block", block_cache_size=2**70)
    with pytest.raises(UserError, match="the model's context is 1024"):
        generate(model, tokenizer, [long_text(3000)], max_new_tokens=4)


def test_a_failed_allocation_is_one_line_naming_what_to_lower(mars_dir, capsys, monkeypatch):
    from marslm.decode import cost_curve

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 4 TB")

    monkeypatch.setattr(cost_curve, "cost_curve", out_of_memory)
    rc, _, err = run(capsys, "bench", "--cost-curve", "--model", mars_dir, "--contexts", "8", "--quiet")
    assert_one_line_error(rc, err, "out of memory (", "can't allocate memory", "lower --batch-sizes or --contexts")
