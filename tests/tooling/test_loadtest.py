"""``marslm loadtest``'s settings, checked once when made, and its run against a fake server."""

from __future__ import annotations

import itertools
import json
import math

import httpx
import pytest

from marslm.bench import loadtest
from marslm.bench.loadtest import LoadtestConfig
from marslm.errors import UserError

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


ORIGINAL = {"policy": "adaptive", "ceiling": 0.97, "floor": 0.8, "slo_ms": 250.0}


@pytest.fixture
def fake_server(monkeypatch):
    """A server that answers every chat request "4" in one chunk, 3 tokens in 2 forwards (or
    ``status`` instead); ``calls`` records the policies posted and the chat requests' bodies."""
    from marslm.data import toy

    calls = {"policies": [], "chats": [], "status": 200}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served"}]})
        if request.url.path == "/admin/policy":
            if request.method == "GET":
                return httpx.Response(200, json=ORIGINAL)
            calls["policies"].append(json.loads(request.content))
            return httpx.Response(200, json={})
        calls["chats"].append(json.loads(request.content))
        if calls["status"] != 200:
            return httpx.Response(calls["status"], text="no such model")
        usage = {"completion_tokens": 3, "forwards": 2, "tokens_per_forward": 1.5}
        chunks = [{"choices": [{"delta": {"content": "4"}}]}, {"choices": [], "usage": usage}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    transport = httpx.MockTransport(handle)
    monkeypatch.setattr(loadtest, "http_client", lambda config: httpx.AsyncClient(transport=transport))
    monkeypatch.setattr(toy, "score_many", lambda examples, texts: [text is not None for text in texts])
    return calls


def test_a_loadtest_interleaves_the_policies_pools_the_rounds_and_restores_the_policy(fake_server):
    config = LoadtestConfig(url="http://fake/", concurrency=[1, 2], requests=3, repeats=2, max_tokens=5)
    report = loadtest.run_loadtest(config, log=lambda line: None)

    bodies = config.policy_bodies()
    keys = {"url", "model", "requests", "repeats", "max_tokens", "data", "concurrency", "policies", "results"}
    assert set(report) == keys and (report["url"], report["model"]) == ("http://fake", "served")
    assert report["policies"] == bodies
    runs = itertools.product(range(2), [1, 2], config.policies)
    restore = {"policy": "adaptive", "tau": 0.97, "tau_floor": 0.8, "slo_ms": 250.0}
    assert fake_server["policies"] == [bodies[name] for _, _, name in runs] + [restore]
    warm_up, *load = fake_server["chats"]
    assert warm_up["max_tokens"] == 8 and len(load) == 2 * 2 * 3 * 3
    assert all(c["model"] == "served" and c["max_tokens"] == 5 and "tau" not in c for c in load)
    assert [(r["policy"], r["concurrency"]) for r in report["results"]] == [
        (p, c) for p in config.policies for c in (1, 2)
    ]
    for r in report["results"]:
        assert (r["requests"], r["ok"], r["tokens_per_forward"], r["accuracy"]) == (6, 6, 1.5, 1.0)
        assert len(r["tokens_per_s_rounds"]) == 2 and r["speedup_vs_tau1"] > 0 and r["accuracy_delta_points"] == 0


def test_a_loadtest_that_sends_nothing_reports_nothing_and_restores_the_policy(fake_server):
    lines = []
    with pytest.raises(UserError, match="no request succeeded, so no report: no run started before --deadline"):
        loadtest.run_loadtest(LoadtestConfig(url="http://fake", deadline=1e-9), log=lines.append)
    assert "the remaining runs were skipped" in lines[-1]
    assert len(fake_server["chats"]) == 1 and len(fake_server["policies"]) == 1  # the warm-up; the restore

    fake_server["status"] = 404
    with pytest.raises(UserError, match="failed the first request, before any load was sent: 404 no such model"):
        loadtest.run_loadtest(LoadtestConfig(url="http://fake"), log=lines.append)
    assert len(fake_server["chats"]) == 2 and len(fake_server["policies"]) == 2
