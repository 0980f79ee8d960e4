"""``marslm loadtest``'s settings, checked once when made."""

from __future__ import annotations

import math

import pytest

from marslm.errors import UserError
from marslm.experiments.loadtest import LoadtestConfig

LOAD = "--requests, --repeats and every --concurrency value must be >= 1"


@pytest.mark.parametrize(
    "settings, fragment",
    [
        (dict(requests=0), LOAD),
        (dict(concurrency=[4, 0]), LOAD),
        (dict(concurrency=[]), LOAD),
        (dict(max_tokens=0), "--max-tokens must be >= 1, got 0"),
        (dict(timeout=math.inf), "--timeout must be a finite number of seconds > 0, got inf"),
        (dict(deadline=0.0), "--deadline must be a finite number of seconds > 0, got 0.0"),
        (dict(policies=[]), "--policies is empty"),
        (dict(policies=["adaptive", "fixed-1.5"]), "bad policy 'fixed-1.5'"),
        (dict(policies=["sometimes"]), "bad policy 'sometimes'; use fixed-<tau> or adaptive"),
        (dict(adaptive_tau=2.0), "--adaptive-tau: tau for the prob metric must be in (0, 1], got 2"),
        (dict(tau_floor=math.nan), "--tau-floor: tau must be a finite number"),
        (dict(vllm_args=("--x",)), "unexpected arguments --x (options after -- are for --engine vllm)"),
        (dict(engine="sglang"), "--engine must be one of marslm, vllm, got 'sglang'"),
        (dict(engine="vllm"), "--engine vllm needs --checkpoint DIR"),
        (dict(engine="vllm", checkpoint="ckpt", repeats=0), LOAD),
        (dict(engine="vllm", checkpoint="ckpt", timeout=-1.0), "--timeout must be a finite number of seconds > 0"),
        (dict(engine="vllm", checkpoint="ckpt", taus=[0.9, 1.5]), "tau for the prob metric must be in (0, 1]"),
    ],
)
def test_loadtest_config_refuses_when_made(settings, fragment):
    with pytest.raises(UserError) as info:
        LoadtestConfig(**settings)
    assert fragment in str(info.value)


def test_each_engine_checks_only_what_it_reads():
    LoadtestConfig(taus=[7.0])  # marslm's engine sends no per-request tau
    LoadtestConfig(engine="vllm", checkpoint="ckpt", policies=[], adaptive_tau=2.0, vllm_args=("--x", "1"))


def test_the_cli_builds_the_config_from_its_options():
    from marslm.cli import build_parser
    from marslm.settings import from_args

    def config(*argv):
        return from_args(LoadtestConfig, build_parser().parse_args(["loadtest", *argv]))

    assert config() == LoadtestConfig()  # one set of defaults
    made = config("--concurrency", "2,4", "--policies", "adaptive,fixed-0.9", "--json", "r.json", "--repeats", "1")
    assert (made.concurrency, made.policies, made.json_path, made.repeats) == (
        [2, 4],
        ["adaptive", "fixed-0.9"],
        "r.json",
        1,
    )
    vllm = config("--engine", "vllm", "--checkpoint", "ckpt", "--", "--gpu-memory-utilization", "0.25")
    assert (vllm.checkpoint, vllm.vllm_args) == ("ckpt", ("--gpu-memory-utilization", "0.25"))
