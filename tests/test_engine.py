"""The serving engine in-process: continuous batching equals offline decoding, live tau, cancel,
queue limits, validation, and the adaptive tau controller (on a fake clock).

The model is the toy-trained checkpoint in float64, so batch shape cannot flip a near-tie and
any difference from ``marslm.generate`` is a real bug.
"""

import asyncio
from dataclasses import replace

import pytest

from marslm import generate
from marslm.chat import encode_prompt
from marslm.data import toy
from marslm.decode import ParamError
from marslm.decode.costs import MaskBatchLimit
from marslm.errors import UserError
from marslm.serve.config import ServeConfig
from marslm.serve.engine import Engine
from marslm.serve.requests import EngineError, QueueFull, request_params
from marslm.serve.tau import TauController
from tests.trained import TRAIN_N, find_long_prompt


@pytest.fixture(scope="module")
def mars64(trained_checkpoints):
    return trained_checkpoints["mars64"]


@pytest.fixture(scope="module")
def long_prompt(mars64):
    return find_long_prompt(*mars64)


def make_engine(mars64, **kwargs) -> Engine:
    model, tokenizer = mars64
    engine = Engine(model, tokenizer, ServeConfig(**kwargs))
    engine.start()
    return engine


async def _drain(stream):
    chunks = [ids async for ids in stream]
    return chunks, stream.result


def test_engine_equals_generate_with_staggered_arrivals(mars64):
    model, tokenizer = mars64
    examples = toy.make_split("train", TRAIN_N, seed=0)[:12]
    settings = [
        dict(
            tau=[1.0, 0.9, 0.7][i % 3],
            max_new_tokens=[16, 40][i % 2],
            block_size=[None, 2, 3, 4][i % 4],
            mode="lossless" if i % 5 == 4 else "threshold",
        )
        for i in range(len(examples))
    ]
    # 12 requests through 3 rows: joins and leaves mid-run. No auto batch limit: it follows the
    # batch's size and this machine's clock, where adaptive width is per row
    engine = make_engine(mars64, max_batch=3, mask_batch_limit=None)
    try:

        async def main():
            tasks = []
            for ex, s in zip(examples, settings):
                stream = engine.submit(encode_prompt(tokenizer, ex.messages), request_params(**s))
                tasks.append(asyncio.ensure_future(_drain(stream)))
                await asyncio.sleep(0.003)  # arrivals spread over the run
            return await asyncio.gather(*tasks)

        outcomes = asyncio.run(main())
    finally:
        engine.stop()
    for ex, s, (chunks, result) in zip(examples, settings, outcomes):
        ref = generate(
            model,
            tokenizer,
            [ex.messages],
            tau=s["tau"],
            max_new_tokens=s["max_new_tokens"],
            block_size=s["block_size"],
            mode=s["mode"],
            mask_batch_limit=None,
        )
        assert result.token_ids == ref.token_ids[0], s
        assert result.forwards == ref.forwards[0], s
        assert abs(result.tokens_per_forward - ref.tokens_per_forward) < 1e-9
        assert [t for c in chunks for t in c] == result.token_ids  # streamed pieces add up
        assert result.finish_reason in ("stop", "length")
    snap = engine.snapshot()
    assert snap["requests"]["finished"] == len(examples) and snap["active_batch"] == 0


@pytest.mark.parametrize("poison", [dict(temperature=1e-45), dict(temperature=1.0, top_k=2**63)])
def test_a_request_that_fails_after_admission_fails_alone(mars64, long_prompt, poison):
    """Settings that get past validation (forced in after it here) fail their own request only,
    in the step (a draw from NaN probabilities) or as the row joins (a top_k no int64 holds): the
    rows running beside it finish with the output they have alone."""
    model, tokenizer = mars64
    prompt = encode_prompt(tokenizer, long_prompt, apply_chat_template=False)
    healthy = [dict(tau=1.0), dict(tau=0.9), dict(mode="lossless")]
    engine = make_engine(mars64, max_batch=4, mask_batch_limit=None)  # the auto limit's text follows the batch
    resolve = engine.resolve
    engine.resolve = lambda ids, params: (
        replace(resolve(ids, params), **poison) if params.seed == 13 else resolve(ids, params)
    )
    try:

        async def main():
            streams = [engine.submit(prompt, request_params(max_new_tokens=40, **s)) for s in healthy]
            for stream in streams:  # running, so the poisoned request joins their batch
                await stream.__aiter__().__anext__()
            poisoned = engine.submit(prompt, request_params(max_new_tokens=40, seed=13))
            with pytest.raises(EngineError, match="decoding failed"):
                await _drain(poisoned)
            return [(await _drain(s))[1] for s in streams]

        results = asyncio.run(main())
        snap = engine.snapshot()
    finally:
        engine.stop()
    for s, result in zip(healthy, results):
        ref = generate(
            model, tokenizer, [prompt], max_new_tokens=40, apply_chat_template=False, mask_batch_limit=None, **s
        )
        assert result.token_ids == ref.token_ids[0], s
    assert snap["requests"]["error"] == 1 and snap["requests"]["finished"] == len(healthy)


def test_default_tau_changes_live_only_for_rows_that_follow_it(mars64, long_prompt):
    _, tokenizer = mars64
    prompt = encode_prompt(tokenizer, long_prompt, apply_chat_template=False)
    engine = make_engine(mars64, max_batch=4, tau=0.95)
    try:

        async def main():
            follows = engine.submit(prompt, request_params(max_new_tokens=300))
            own = engine.submit(prompt, request_params(max_new_tokens=300, tau=0.9))
            it_follows, it_own = follows.__aiter__(), own.__aiter__()
            await it_follows.__anext__()  # both rows are running now
            await it_own.__anext__()
            engine.set_policy(tau=0.85)  # takes effect at the next step, no restart
            later = engine.submit(prompt, request_params(max_new_tokens=4))
            return [await _drain(s) for s in (follows, own, later)]

        (_, follows), (_, own), (_, later) = asyncio.run(main())
    finally:
        engine.stop()
    assert follows.tau == 0.85  # it was running when the default changed, and followed it
    assert own.tau == 0.9
    assert later.tau == 0.85
    assert engine.snapshot()["tau"]["changes"]["down"] == 1


def test_cancel_frees_the_row_before_the_next_step(mars64, long_prompt):
    _, tokenizer = mars64
    prompt = encode_prompt(tokenizer, long_prompt, apply_chat_template=False)
    engine = make_engine(mars64, max_batch=2)
    try:

        async def main():
            stream = engine.submit(prompt, request_params(max_new_tokens=300, tau=1.0))
            first = await stream.__aiter__().__anext__()
            engine.cancel(stream.request_id)
            chunks, result = await _drain(stream)
            return first, result

        first, result = asyncio.run(main())
        snap = engine.snapshot()
    finally:
        engine.stop()
    assert first and result.finish_reason == "cancelled"
    assert len(result.token_ids) < 300
    assert snap["active_batch"] == 0 and snap["requests"]["cancelled"] == 1


def test_full_queue_refuses_and_stop_cancels_what_is_left(mars64, long_prompt):
    _, tokenizer = mars64
    prompt = encode_prompt(tokenizer, long_prompt, apply_chat_template=False)
    engine = make_engine(mars64, max_batch=1, max_queue=1)

    async def main():
        running = engine.submit(prompt, request_params(max_new_tokens=300, tau=1.0))
        await running.__aiter__().__anext__()  # it holds the one row now
        streams = [running, engine.submit(prompt, request_params(max_new_tokens=300, tau=1.0))]  # queued
        with pytest.raises(QueueFull) as refused:
            engine.submit(prompt, request_params(max_new_tokens=300, tau=1.0))
        assert refused.value.retry_after >= 1
        await asyncio.to_thread(engine.stop, 0.05)  # shutdown: no patience, cancel the rest
        return [await _drain(s) for s in streams]

    outcomes = asyncio.run(main())
    assert [r.finish_reason for _, r in outcomes] == ["cancelled", "cancelled"]
    assert engine.snapshot()["requests"]["rejected"] == 1
    assert not engine.alive


def test_validation(mars64):
    model, tokenizer = mars64
    engine = Engine(model, tokenizer, ServeConfig(max_tokens=256, max_tokens_limit=512))  # not started
    ids = [5] * 10
    bad = [
        (request_params(tau=1.5), "tau"),
        (request_params(tau=0.0), "tau"),
        (request_params(tau=-1.0, metric="entropy"), "tau"),
        (request_params(metric="entropy"), "tau"),
        (request_params(metric="nope"), "metric"),
        (request_params(block_size=5), "block_size"),
        (request_params(block_size=0), "block_size"),
        (request_params(mode="fast"), "mode"),
        (request_params(mode="lossless", block_size=1), "block_size"),
        (request_params(max_new_tokens=0), "max_tokens"),
        (request_params(max_new_tokens=513), "max_tokens"),
        (request_params(temperature=-1.0), "temperature"),
    ]
    for params, field in bad:
        with pytest.raises(ParamError) as err:
            engine.resolve(ids, params)
        assert err.value.param == field, params
    with pytest.raises(ParamError) as err:
        engine.resolve([5] * 1000, request_params(max_new_tokens=100))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(ParamError):
        engine.resolve([], request_params())
    # defaults: the trained block size, max_tokens capped by what the context has left; a request that
    # names no tau keeps None, and takes the server's default as it joins the batch (the live test below)
    row = engine.resolve([5] * 1000, request_params())
    assert (row.block_size, row.tau, row.max_new_tokens) == (4, None, 24)
    assert engine.resolve(ids, request_params(tau=0.3, metric="entropy")).tau == 0.3


def test_tau_controller_fixed_and_adaptive():
    fixed = TauController(tau=0.95, policy="fixed", floor=0.8, slo_ms=None, max_batch=8)
    assert fixed.observe(0.0, 100, 5.0) == 0.95  # fixed ignores load

    c = TauController(tau=0.95, policy="adaptive", floor=0.8, slo_ms=None, max_batch=8, recover_per_s=0.1)
    assert c.observe(0.0, 0, 5.0) == 0.95
    assert c.observe(0.1, 2, 5.0) == 0.91  # a quarter batch waiting: a quarter down
    assert c.observe(0.2, 40, 5.0) == 0.8  # saturated: the floor, at once
    assert c.observe(0.3, 0, None) == 0.81  # load gone: climbs back slowly ...
    for t in range(31, 81):  # ... in many short turns ...
        c.observe(t / 100, 0, 2.0)
    assert c.tau == 0.86  # ... 0.1 per second
    assert c.observe(5.0, 0, None) == 0.95  # ... up to the ceiling, not beyond
    changes = c.state()["changes"]
    assert changes["down"] == 2 and changes["up"] >= 3

    slo = TauController(tau=0.95, policy="adaptive", floor=0.8, slo_ms=100, max_batch=8)
    assert slo.observe(0.0, 0, 90.0) == 0.95  # under the SLO: no pressure
    assert slo.observe(0.1, 0, 400.0) < 0.95  # steps over the SLO: tau falls

    c.configure(tau=0.9)  # admin: a new default is the ceiling
    assert c.state()["tau"] == 0.9 and c.ceiling == 0.9
    for bad in [dict(policy="sometimes"), dict(tau=1.5), dict(floor=0.99), dict(slo_ms=-5)]:
        with pytest.raises(UserError):
            c.configure(**bad)
    assert c.state()["tau"] == 0.9  # a refused change leaves the state alone


def test_tau_controller_honours_exact_bounds_and_refuses_non_finite():
    from marslm.errors import UserError

    controller = TauController(tau=0.004, policy="fixed", floor=0.004, slo_ms=None, max_batch=8)
    assert controller.tau == 0.004  # not rounded to 0.0
    controller.configure(policy="adaptive", tau=0.123456, floor=0.1)
    assert controller.observe(0.0, 0, None) == 0.123456  # no load: exactly the ceiling
    assert controller.observe(1.0, 100, None) == 0.1  # full pressure: exactly the floor
    before = controller.state()
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(UserError):
            controller.configure(slo_ms=bad)
    assert controller.state() == before  # nothing applied


def test_the_mask_batch_limit_reaches_the_batch(mars64):
    model, tokenizer = mars64
    engine = Engine(model, tokenizer, ServeConfig(mask_batch_limit=8))  # not started
    assert engine._batch.mask_batch_limit == 8
    with pytest.raises(UserError, match="--mask-batch-limit"):
        ServeConfig(mask_batch_limit=0)


def test_cpu_threads_leave_a_core_for_the_front_end(monkeypatch):
    import os

    from marslm.modeling import cpu_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpu_threads() == 3 and cpu_threads(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu_threads() == 1
    with pytest.raises(UserError, match="--threads"):
        ServeConfig(threads=0)


def test_the_auto_load_policy_reads_the_saved_cost_table_and_answers_name_it(mars64, tmp_path, monkeypatch):
    """``--mask-batch-limit auto`` is a load policy switched on: it reads the table beside the
    checkpoint (no timing at start), without one it sets no limit, and each result names it."""
    from marslm.decode import costs

    model, tokenizer = mars64
    costs.save_cost_table(tmp_path, {"block_size": 4, "costs": {"1": 1.1, "2": 1.2, "4": 9.0}, "measured_on": {}})
    monkeypatch.setattr(model, "name_or_path", str(tmp_path))
    engine = Engine(model, tokenizer, ServeConfig(mask_batch_limit="auto", max_batch=6))
    engine.start(warmup=False)
    try:
        assert engine.mask_limit.step_cost == {1: 1.1, 2: 1.2, 4: 9.0}
        assert engine._batch.mask_batch_limit == engine.mask_limit.limit == 2

        async def one():
            stream = engine.submit([5, 6, 7], request_params(tau=0.9, max_new_tokens=4))
            async for _ in stream:
                pass
            return stream.result

        assert asyncio.run(one()).mask_batch_limit == "auto"
    finally:
        engine.stop()
    monkeypatch.setattr(model, "name_or_path", str(tmp_path / "elsewhere"))
    bare = Engine(model, tokenizer, ServeConfig(mask_batch_limit="auto", max_batch=6))
    bare.start(warmup=False)
    bare.stop()
    assert bare.mask_limit is None and bare._batch.mask_batch_limit is None
    with pytest.raises(UserError, match="auto"):
        ServeConfig(mask_batch_limit="sometimes")


@pytest.mark.parametrize("cost, pays", [(100.0, False), (0.01, True)])
def test_an_auto_limit_reads_no_masks_where_they_cannot_pay(mars64, long_prompt, cost, pays):
    """The engine steps through ``MaskBatchLimit.step``: with step costs far above what masks buy
    (limit 0), no step of several rows reads masks; with costs below it (the control), they do."""
    model, tokenizer = mars64
    engine = Engine(model, tokenizer, ServeConfig(mask_batch_limit="auto", max_batch=4))
    engine.mask_limit = MaskBatchLimit({1: cost, 2: cost, 4: cost}, most=9)  # set before start(): nothing is timed
    batch, real_step, steps = engine._batch, engine._batch.step, []

    def recorded_step():
        rows, before = len(batch), batch.stats.masked_row_steps
        finished = real_step()
        steps.append((rows, batch.stats.masked_row_steps - before))
        return finished

    batch.step = recorded_step
    engine.start(warmup=False)
    prompt = encode_prompt(tokenizer, long_prompt, apply_chat_template=False)
    try:

        async def main():
            streams = [engine.submit(prompt, request_params(max_new_tokens=24, tau=0.5)) for _ in range(4)]
            return await asyncio.gather(*(_drain(s) for s in streams))

        results = [result for _, result in asyncio.run(main())]
    finally:
        engine.stop()
    together = [masked for rows, masked in steps if rows > 1]
    assert together and engine.mask_limit.limit == (4 if pays else 0)
    assert (sum(together) > 0) == pays
    assert all(len(r.token_ids) == 24 for r in results)
