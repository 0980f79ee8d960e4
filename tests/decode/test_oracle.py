"""MARS decoding below tau = 1 against an independent reference sampler (tests/reference_sampler.py).

The decoder's cache modes are compared with each other elsewhere; that cannot catch a bug they
share (a mask placed one position off, a candidate read from the wrong column, the acceptance
rule itself). Here every cache mode must reproduce, token for token and step for step, a plain
per-row loop with no cache that follows the reference sampler's rule. float64, on the trained
tiny checkpoint, so no near-tie can flip.
"""

from functools import cache

import pytest

from marslm import generate
from marslm.chat import encode_prompt, stop_token_ids
from marslm.data import toy
from marslm.decode import PAPER_RULE
from marslm.mars_json import MarsConfig
from tests.decode.reference_sampler import reference_generate
from tests.trained import TRAIN_N

TAUS = (0.95, 0.8, 0.6)
METRICS = ("prob", "entropy", "margin")
MAX_NEW = 40
BLOCK_CACHE = 8


@pytest.fixture(scope="module")
def setup(trained_checkpoints):
    model, tokenizer = trained_checkpoints["mars64"]
    config = MarsConfig.load(trained_checkpoints["mars_dir"])
    examples = toy.make_split("train", TRAIN_N, seed=0)
    # memorised prompts (confident masks) and one held-out prompt (unconfident ones), of ragged lengths
    prompts = [encode_prompt(tokenizer, ex.messages) for ex in (examples[3], examples[10], examples[21])]
    prompts.append(encode_prompt(tokenizer, toy.make_split("test", 1, seed=5)[0].messages))
    assert len(set(map(len, prompts))) > 1
    stop = set(stop_token_ids(tokenizer, model.generation_config))

    @cache
    def reference(index: int, tau: float, metric: str, window: str, adaptive: bool = False, last_mask: bool = False):
        return reference_generate(
            model,
            prompts[index],
            mask_id=config.mask_token_id,
            stop_ids=stop,
            tau=tau,
            metric=metric,
            block_size=config.block_size,
            max_new_tokens=MAX_NEW,
            window=window,
            block_cache_size=BLOCK_CACHE,
            adaptive=adaptive,
            last_mask=last_mask,
        )

    return model, tokenizer, prompts, reference


@pytest.mark.parametrize("cache", ["none", "cursor", "block"])
@pytest.mark.parametrize("metric", METRICS)
def test_decoding_equals_the_reference_sampler(setup, cache, metric):
    model, tokenizer, prompts, reference = setup
    window = "block" if cache == "block" else "sliding"
    multi_token_steps = 0
    for tau in TAUS:
        for rows in ([0], [0, 1, 2, 3]):  # one prompt, then a ragged batch
            out = generate(
                model,
                tokenizer,
                [prompts[i] for i in rows],
                tau=tau,
                metric=metric,
                cache=cache,
                block_cache_size=BLOCK_CACHE,
                use_last_mask=False,
                max_new_tokens=MAX_NEW,
                **PAPER_RULE,
            )
            for i, ids, steps in zip(rows, out.token_ids, out.accepted_per_step):
                expected_ids, expected_steps = reference(i, tau, metric, window)
                assert ids == expected_ids, (tau, i)
                assert steps == expected_steps, (tau, i)
                multi_token_steps += sum(s > 1 for s in steps)
    assert multi_token_steps > 10  # the comparison exercised multi-token acceptance


@pytest.mark.parametrize("cache", ["none", "cursor"])
@pytest.mark.parametrize("metric", METRICS)
def test_adaptive_width_only_shortens_the_reach(setup, cache, metric):
    """A resting row (adaptive width: no masks after refused steps) accepts what the reference
    accepts from its AR candidate alone: resting never changes a prediction (causal attention),
    only how far a step can reach."""
    model, tokenizer, prompts, reference = setup
    narrowed = 0
    for tau in TAUS:
        out = generate(
            model,
            tokenizer,
            prompts,
            tau=tau,
            metric=metric,
            cache=cache,
            use_last_mask=False,
            max_new_tokens=MAX_NEW,
            **{**PAPER_RULE, "adaptive_width": True},  # no batch limit: it reads this machine's clock
        )
        for i, (ids, steps) in enumerate(zip(out.token_ids, out.accepted_per_step)):
            assert (ids, steps) == reference(i, tau, metric, "sliding", adaptive=True), (tau, i)
            narrowed += ids != reference(i, tau, metric, "sliding")[0]
    assert narrowed  # the rests did change some answers' path, so the check had teeth


@pytest.mark.parametrize("cache", ["none", "cursor"])
def test_the_paper_rule_is_the_reference_sampler(setup, cache):
    """``PAPER_RULE`` (every step reads its masks) is the paper's sampler at tau < 1, token for token
    and step for step; with marslm's default of reading the last mask too, it is the same sampler
    with B+1 candidates."""
    model, tokenizer, prompts, reference = setup
    multi_token_steps = 0
    for tau in TAUS:
        common = dict(tau=tau, cache=cache, max_new_tokens=MAX_NEW, **PAPER_RULE)
        paper = generate(model, tokenizer, prompts, use_last_mask=False, **common)
        last_mask = generate(model, tokenizer, prompts, **common)
        for i in range(len(prompts)):
            assert (paper.token_ids[i], paper.accepted_per_step[i]) == reference(i, tau, "prob", "sliding"), (tau, i)
            expected = reference(i, tau, "prob", "sliding", last_mask=True)
            assert (last_mask.token_ids[i], last_mask.accepted_per_step[i]) == expected, (tau, i)
            multi_token_steps += sum(s > 1 for s in paper.accepted_per_step[i])
    assert multi_token_steps > 10


def test_every_surface_takes_the_one_default(make_tiny_model, tiny_tokenizer):
    """generate, the decoding batch, eval, bench and their CLIs read their defaults from
    ``ADAPTIVE_WIDTH`` and ``MASK_BATCH_LIMIT``: the fallback, which ``PAPER_RULE`` turns off. The
    server takes adaptive width from there too; its batch limit is a load policy, off by default,
    so that a request's text does not follow the load."""
    import inspect

    from marslm.bench.config import BenchConfig
    from marslm.cli import build_parser
    from marslm.decode import ADAPTIVE_WIDTH, MASK_BATCH_LIMIT, DecodeBatch, DecoderOptions
    from marslm.eval.evaluate import EvalConfig, plan_cells
    from marslm.serve.config import ServeConfig
    from marslm.serve.engine import Engine

    assert (ADAPTIVE_WIDTH, MASK_BATCH_LIMIT) == (True, "auto")
    assert PAPER_RULE == {"adaptive_width": False, "mask_batch_limit": None}
    for fn in (DecodeBatch.__init__, plan_cells):
        assert inspect.signature(fn).parameters["adaptive_width"].default is ADAPTIVE_WIDTH, fn
    assert inspect.signature(plan_cells).parameters["mask_batch_limit"].default == MASK_BATCH_LIMIT
    # generate's and evaluate's default decoder, eval's, bench's and the server's settings
    for config in (DecoderOptions(), EvalConfig(models=["m"]), BenchConfig(model="m", ar_model="a")):
        assert (config.adaptive_width, config.mask_batch_limit) == (ADAPTIVE_WIDTH, MASK_BATCH_LIMIT), config
    assert (ServeConfig().adaptive_width, ServeConfig().mask_batch_limit) == (ADAPTIVE_WIDTH, MASK_BATCH_LIMIT)
    model = make_tiny_model()
    assert Engine(model, tiny_tokenizer, ServeConfig())._batch.adaptive_width is ADAPTIVE_WIDTH  # not started
    assert Engine(model, tiny_tokenizer, ServeConfig(adaptive_width=False))._batch.adaptive_width is False
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["eval"], ["bench", "--ar-model", "a"], ["serve"]):
        args = parser.parse_args(argv[:1] + ["--model", "m"] + argv[1:])
        assert (args.adaptive_width, args.mask_batch_limit) == (ADAPTIVE_WIDTH, MASK_BATCH_LIMIT), argv
        paper = parser.parse_args(
            argv[:1] + ["--model", "m", "--no-adaptive-width", "--mask-batch-limit", "off"] + argv[1:]
        )
        assert {k: getattr(paper, k) for k in PAPER_RULE} == PAPER_RULE, argv
