"""What a user gets with no flags: the step compiled where the device can (compile_policy.py), its
graphs kept on disk across processes, a static cache sized from a bound known up front, the cost
table measured on first need and kept (costs.py), and one loop for ``generate`` and the server
(run_loop.py).

The suite runs with ``MARSLM_COMPILE=off`` and ``MARSLM_COSTS=off`` (tests/conftest.py); these
tests set them back where they test the defaults themselves."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import marslm
from marslm.decode import compile_policy, costs, forward
from marslm.decode.batch import DecodeBatch
from marslm.decode.run_loop import RunLoop
from marslm.errors import UserError

TOKEN_PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15, 16, 17, 18]]


@pytest.fixture
def saved_tiny(make_tiny_model, tiny_tokenizer, save_model, tmp_path):
    """A random model saved and loaded back, so that it names a checkpoint folder."""
    folder = save_model(make_tiny_model(), tiny_tokenizer, tmp_path / "tiny")
    return marslm.load(str(folder))


# ------------------------------------------------------------------------------ compile="auto"
def test_auto_compiles_where_a_compiler_is_and_says_why_not_once_elsewhere(monkeypatch, caplog):
    monkeypatch.setenv(compile_policy.COMPILE_ENV, "auto")
    cpu = torch.device("cpu")
    monkeypatch.setattr(compile_policy.shutil, "which", lambda name: "/usr/bin/" + name)
    assert compile_policy.resolve_compile("auto", "cursor", cpu) is True
    assert compile_policy.resolve_compile("auto", "block", cpu) is False  # no compiled step there
    monkeypatch.setattr(compile_policy.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(compile_policy, "_said", set())
    with caplog.at_level(logging.WARNING, logger="marslm.compile"):
        assert compile_policy.resolve_compile("auto", "cursor", cpu) is False
        assert compile_policy.resolve_compile("auto", "cursor", cpu) is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "\n" not in lines[0]
    with pytest.raises(UserError, match="no C\\+\\+ compiler") as refused:
        compile_policy.resolve_compile(True, "cursor", cpu)
    assert "\n" not in str(refused.value)
    assert compile_policy.resolve_compile(False, "cursor", cpu) is False
    # the names resolve_device gives: None is the CPU; a numbered CUDA device is CUDA
    assert compile_policy.cannot_compile(None) == compile_policy.cannot_compile(cpu)
    assert compile_policy.cannot_compile("cuda:1") is None and compile_policy.cannot_compile("cpu") is not None


def test_a_missing_compiler_decodes_eagerly_as_the_default_would(monkeypatch, make_tiny_model, tiny_tokenizer):
    model = make_tiny_model()
    eager = marslm.generate(model, tiny_tokenizer, TOKEN_PROMPTS, tau=0.5, max_new_tokens=8, compile=False)
    monkeypatch.setenv(compile_policy.COMPILE_ENV, "auto")
    monkeypatch.setattr(compile_policy, "AUTO_COMPILE_WORK", 0)  # the compiler alone decides
    monkeypatch.setattr(compile_policy.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    out = marslm.generate(model, tiny_tokenizer, TOKEN_PROMPTS, tau=0.5, max_new_tokens=8)
    assert out.stats.compiled is False and out.token_ids == eager.token_ids


def test_machine_wide_off_and_a_bad_setting(monkeypatch):
    monkeypatch.setenv(compile_policy.COMPILE_ENV, "off")
    assert compile_policy.resolve_compile("auto", "cursor", torch.device("cpu")) is False
    monkeypatch.setenv(compile_policy.COMPILE_ENV, "sometimes")
    with pytest.raises(UserError, match="MARSLM_COMPILE"):
        compile_policy.resolve_compile("auto", "cursor", torch.device("cpu"))
    for bad in ("yes", 1, None):
        with pytest.raises(UserError, match="compile must be"):
            marslm.DecoderOptions(compile=bad)


def test_auto_is_the_default_and_compiles_a_call_with_enough_to_decode(monkeypatch, make_tiny_model, tiny_tokenizer):
    """No flag: a call of more than ``AUTO_COMPILE_WORK`` tokens (prompts x max_new_tokens)
    compiles, a smaller one decodes eagerly (its graphs would cost more than its steps save); the
    text is the same either way."""
    monkeypatch.setattr(forward, "BACKEND", "eager")
    monkeypatch.setenv(compile_policy.COMPILE_ENV, "auto")
    monkeypatch.setattr(compile_policy, "AUTO_COMPILE_WORK", 4 * 8 - 1)
    model = make_tiny_model()
    out = marslm.generate(model, tiny_tokenizer, TOKEN_PROMPTS, tau=0.5, max_new_tokens=8)
    eager = marslm.generate(model, tiny_tokenizer, TOKEN_PROMPTS, tau=0.5, max_new_tokens=8, compile=False)
    assert out.stats.compiled and out.stats.compiled_steps > 0
    assert out.token_ids == eager.token_ids
    small = marslm.generate(model, tiny_tokenizer, TOKEN_PROMPTS[:3], tau=0.5, max_new_tokens=8)
    assert not small.stats.compiled and small.token_ids == eager.token_ids[:3]
    assert compile_policy.resolve_compile("auto", "cursor", torch.device("cpu"), work=None)  # a server


# ------------------------------------------------------------------------------ the graph set
def test_the_static_cache_is_sized_from_the_bound_not_the_first_rows(make_tiny_model):
    model = make_tiny_model()
    facts = dict(mask_token_id=3, stop_ids=[2], pad_id=0)
    batch = DecodeBatch(model, compile=True, max_len=300, **facts)
    batch.add([[5, 6, 7]], [marslm.DecodingParams(max_new_tokens=4).validate(8)], ["a"])
    batch._inputs()
    assert batch.kv.capacity == forward.static_capacity(300) == batch.capacity
    # a short call and a long one under the same power of two meet the same graphs
    assert forward.static_capacity(40 + 256) == forward.static_capacity(200 + 256)


# ------------------------------------------------------------------------------ the kept graphs
CHILD = textwrap.dedent(
    """
    import json, sys
    import marslm
    model, tokenizer = marslm.load(sys.argv[1])
    out = marslm.generate(model, tokenizer, [[5, 6, 7, 8]], tau=1.0, max_new_tokens=6, compile=True)
    print(json.dumps({"ids": out.token_ids, "compiled": out.stats.compiled_steps}))
    """
)


@pytest.mark.slow
def test_a_damaged_compile_cache_entry_is_rebuilt_with_one_warning(tmp_path, tiny_model_dir):
    """Inductor (the backend users get) in two processes over one cache folder: the second finds
    entries, all damaged on disk; it warns in one line, rebuilds them and decodes the same tokens."""
    env = {k: v for k, v in os.environ.items() if k != compile_policy.INDUCTOR_CACHE_ENV}
    env.update(MARSLM_CACHE=str(tmp_path / "cache"), MARSLM_COMPILE="auto")

    def child():
        argv = [sys.executable, "-c", CHILD, str(tiny_model_dir)]
        run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr

    first, _ = child()
    kept = tmp_path / "cache" / "inductor"
    entries = [p for p in kept.rglob("*") if p.is_file() and {"fxgraph", "aotautograd"} & set(p.parts)]
    assert entries and first["compiled"] > 0
    for entry in entries:
        entry.write_bytes(b"\x00damaged")
    again, err = child()
    assert again == first
    warnings = [line for line in err.splitlines() if "damaged compile-cache entry" in line]
    assert warnings and "Traceback" not in err


# ------------------------------------------------------------------------------ the kept cost table
def test_the_cost_table_is_measured_on_first_use_then_read(saved_tiny, monkeypatch):
    monkeypatch.setenv(costs.COSTS_ENV, "auto")
    model, tokenizer = saved_tiny
    settings = dict(tau=0.5, max_new_tokens=8, batch_size=2, compile=False)
    first = marslm.generate(model, tokenizer, TOKEN_PROMPTS, **settings)
    kept = first.stats.cost_table
    assert kept is not None and kept.startswith(str(costs.cache_root() / "costs"))
    table = json.loads(open(kept).read())
    assert table["key"]["block_size"] == 4 and table["key"]["compiled"] is False
    assert set(table["costs"]) == {"1", "2"}  # the batch sizes a batch of 2 rows is padded to

    def no_measuring(*_, **__):
        raise AssertionError("measured again")

    real_measure = costs.measure_table
    monkeypatch.setattr(costs, "measure_table", no_measuring)
    again = marslm.generate(model, tokenizer, TOKEN_PROMPTS, **settings)
    assert again.stats.cost_table == kept and again.token_ids == first.token_ids
    # a larger batch measures the sizes it lacks alone, and keeps the ones there
    measured = []

    def only_missing(model, block_size, *, batch_sizes, **kw):
        measured.append(list(batch_sizes))
        return real_measure(model, block_size, batch_sizes=batch_sizes, **kw)

    monkeypatch.setattr(costs, "measure_table", only_missing)
    marslm.generate(model, tokenizer, TOKEN_PROMPTS, **{**settings, "batch_size": 4})
    grown = json.loads(open(kept).read())["costs"]
    assert measured == [[4]] and set(grown) == {"1", "2", "4"} and grown["2"] == table["costs"]["2"]


def test_a_table_for_another_dtype_block_size_or_step_is_not_used(saved_tiny, monkeypatch):
    monkeypatch.setenv(costs.COSTS_ENV, "auto")
    model, tokenizer = saved_tiny
    settings = dict(tau=0.5, max_new_tokens=4, batch_size=2, compile=False)
    paths = {marslm.generate(model, tokenizer, TOKEN_PROMPTS, **settings).stats.cost_table}
    paths.add(marslm.generate(model, tokenizer, TOKEN_PROMPTS, block_size=3, **settings).stats.cost_table)
    key = costs.kept_table_key(model, 4, compiled=True)
    assert key["digest"] not in "".join(paths)  # the compiled step's table is another one
    model.to(torch.float64)
    paths.add(marslm.generate(model, tokenizer, TOKEN_PROMPTS, **settings).stats.cost_table)
    assert len(paths) == 3 and None not in paths


def test_a_damaged_kept_table_is_measured_again_with_one_warning(saved_tiny, monkeypatch, caplog):
    monkeypatch.setenv(costs.COSTS_ENV, "auto")
    model, tokenizer = saved_tiny
    settings = dict(tau=0.5, max_new_tokens=4, batch_size=2, compile=False)
    kept = marslm.generate(model, tokenizer, TOKEN_PROMPTS, **settings).stats.cost_table
    open(kept, "w").write('{"costs": {"1": "cheap"')
    with caplog.at_level(logging.WARNING, logger="marslm.costs"):
        again = marslm.generate(model, tokenizer, TOKEN_PROMPTS, **settings)
    assert again.stats.cost_table == kept and json.loads(open(kept).read())["costs"]
    assert [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]


def test_costs_off_reads_saved_tables_only(saved_tiny, monkeypatch):
    monkeypatch.setenv(costs.COSTS_ENV, "off")
    model, tokenizer = saved_tiny
    out = marslm.generate(model, tokenizer, TOKEN_PROMPTS, tau=0.5, max_new_tokens=4, batch_size=2, compile=False)
    assert out.stats.cost_table is None


# ------------------------------------------------------------------------------ one loop
def test_generate_and_the_server_step_through_one_loop(trained_checkpoints, monkeypatch):
    """Both drive their decoder through ``RunLoop.step``: replacing it is seen by each."""
    import asyncio

    from marslm.serve.config import ServeConfig
    from marslm.serve.engine import Engine
    from marslm.serve.requests import request_params

    model, tokenizer = trained_checkpoints["mars64"]
    turns = []
    real = RunLoop.step

    def counted(self):
        turns.append(len(self))
        return real(self)

    monkeypatch.setattr(RunLoop, "step", counted)
    out = marslm.generate(model, tokenizer, [[5, 6, 7]], tau=0.9, max_new_tokens=6)
    assert len(turns) == out.stats.forwards
    turns.clear()
    engine = Engine(model, tokenizer, ServeConfig(max_batch=2))
    engine.start(warmup=False)
    try:

        async def one():
            stream = engine.submit([5, 6, 7], request_params(tau=0.9, max_new_tokens=6, stop=("zz",)))
            async for _ in stream:
                pass
            return stream.result

        result = asyncio.run(one())
    finally:
        engine.stop()
    assert len(turns) == engine.metrics.forwards == result.forwards > 0


def test_make_decoder_builds_every_decoder(trained_checkpoints, monkeypatch):
    """generate (plain and with a drafter), Jacobi decoding and a drafted server each get their
    decoder from ``make_decoder``: replacing it is seen by all four."""
    from marslm.decode import decoder as decoder_module
    from marslm.decode import jacobi, run_loop
    from marslm.serve import engine as engine_module
    from marslm.serve.config import ServeConfig
    from marslm.serve.engine import Engine

    model, tokenizer = trained_checkpoints["mars64"]
    draft = trained_checkpoints["ar64"][0]
    built = []
    real = decoder_module.make_decoder

    def counted(*args, **kwargs):
        made = real(*args, **kwargs)
        built.append(type(made).__name__)
        return made

    for module in (decoder_module, run_loop, jacobi, engine_module):
        monkeypatch.setattr(module, "make_decoder", counted)
    marslm.generate(model, tokenizer, [[5, 6, 7]], tau=0.9, max_new_tokens=4)
    marslm.generate(model, tokenizer, [[5, 6, 7]], tau=0.9, max_new_tokens=4, draft_model=draft, num_draft_tokens=2)
    jacobi.jacobi_generate(model, tokenizer, [[5, 6, 7]], window=2, max_new_tokens=4, apply_chat_template=False)
    Engine(model, tokenizer, ServeConfig(), drafting=dict(draft_model=draft, num_draft_tokens=2))
    assert built == ["DecodeBatch", "DraftedBatch", "JacobiBatch", "DraftedBatch"]


def test_one_graph_per_bucket_however_requests_come_and_go(trained_checkpoints, monkeypatch):
    """A long-lived decoder's static cache holds its most rows from the first step, so a bucket of
    rows met before and after the batch filled is one graph, not one per buffer size: what lets
    the server's warm-up build the graphs its requests meet."""
    import asyncio

    from torch._dynamo.utils import counters

    from marslm.serve.config import ServeConfig
    from marslm.serve.engine import Engine
    from marslm.serve.requests import request_params
    from tests.trained import find_long_prompt

    monkeypatch.setattr(forward, "BACKEND", "eager")  # the same graphs, without code generation
    model, tokenizer = trained_checkpoints["mars64"]
    engine = Engine(model, tokenizer, ServeConfig(max_batch=4, compile=True, mask_batch_limit=None))
    engine.start(warmup=False)
    graphs, keys = counters["stats"]["unique_graphs"], set(forward._TRACED)

    async def run(prompt, tokens):
        stream = engine.submit(prompt, request_params(max_new_tokens=tokens, tau=1.0))
        async for _ in stream:
            pass
        return stream.result

    async def waves():
        long_prompt = tokenizer(find_long_prompt(model, tokenizer, tokens=80))["input_ids"]
        alone = asyncio.ensure_future(run(long_prompt, 80))
        for _ in range(500):  # it runs alone first: the buffers are made for one row
            if engine.metrics.forwards or alone.done():
                break
            await asyncio.sleep(0.01)
        await asyncio.gather(*[run([9 + i, 10, 11], 6) for i in range(3)])  # four rows, then it alone again
        return await alone

    try:
        last = asyncio.run(waves())
    finally:
        engine.stop()
    assert last.compiled and last.finish_reason in ("stop", "length")
    new_keys = set(forward._TRACED) - keys
    assert counters["stats"]["unique_graphs"] - graphs == len(new_keys) > 1


def test_every_thread_may_run_as_many_graphs_as_the_step_needs():
    """dynamo's limit of graphs per function is a per-thread setting: a server warms up on one
    thread and decodes on another, so each thread that steps raises it."""
    import threading

    import torch._dynamo

    seen = []

    def step_here():
        forward._compiled_forward()
        seen.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=step_here)
    thread.start()
    thread.join()
    assert seen == [forward.RECOMPILE_LIMIT]
