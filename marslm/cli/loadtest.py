"""``marslm loadtest``: throughput, latency and accuracy of a server under load, per tau policy."""

from __future__ import annotations

import math
import sys

from ..errors import UserError
from .common import add_unsafe_exec, code_execution, floats, ints, no_extra_args, write_json

COMMAND = "loadtest"


def add_parser(sub) -> None:
    from ..experiments.loadtest import POLICIES

    lt = sub.add_parser(
        COMMAND,
        help="throughput, latency and accuracy of a running server per tau policy",
        description="Send toy test-split prompts to a running `marslm serve` at each concurrency, "
        "under each tau policy (set through the server's admin API), and report throughput, "
        "latency percentiles, tokens per forward and accuracy.",
    )
    lt.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    lt.add_argument("--concurrency", type=ints, default=[1, 8, 32], help="comma-separated levels (default 1,8,32)")
    lt.add_argument("--requests", type=int, default=64, help="requests per policy and level (default 64)")
    lt.add_argument(
        "--policies",
        type=lambda t: [p for p in t.split(",") if p],
        default=list(POLICIES),
        help="comma-separated: fixed-<tau> or adaptive (default fixed-1.0,fixed-0.95,adaptive)",
    )
    lt.add_argument("--adaptive-tau", type=float, default=0.95, help="ceiling of the adaptive policy (0.95)")
    lt.add_argument("--tau-floor", type=float, default=0.9, help="floor of the adaptive policy (0.9)")
    lt.add_argument("--max-tokens", type=int, default=192)
    lt.add_argument("--api-key", default=None, help="the server's --api-key (the admin API needs it)")
    lt.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    lt.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    lt.add_argument("--deadline", type=float, default=3600.0, help="skip remaining runs after this many seconds")
    lt.add_argument("--seed", type=int, default=0, help="seed of the toy test split")
    lt.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    lt.add_argument(
        "--engine",
        choices=["marslm", "vllm"],
        default="marslm",
        help="vllm: start vLLM servers on --checkpoint (plain, ngram and MARS, in the environment of "
        "`make vllm-env`) and compare vLLM plain AR, ngram, MARS lossless and MARS at --taus; "
        "--url and the policies do not apply",
    )
    lt.add_argument("--checkpoint", default=None, metavar="DIR", help="with --engine vllm: the checkpoint to serve")
    lt.add_argument("--taus", type=floats, default=[0.95], help="with --engine vllm: MARS taus (default 0.95)")
    lt.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved rounds: each runs every level and every policy (vLLM: every server) once, "
        "side by side, so a shared machine's drift slows them alike (default 3)",
    )
    lt.add_argument(
        "vllm_args",
        nargs="*",
        metavar="-- VLLM_ARGS",
        help="with --engine vllm: options for every `vllm serve`, e.g. -- --gpu-memory-utilization 0.25",
    )
    add_unsafe_exec(lt)
    lt.set_defaults(run=run)


def run(args) -> int:
    from ..experiments.loadtest import format_table, policy_settings, run_loadtest

    if args.engine == "vllm":
        return _loadtest_vllm(args)
    no_extra_args(args)
    _check_load(args)
    if not args.policies:
        raise UserError("--policies is empty")
    for name in args.policies:
        policy_settings(name, args.adaptive_tau, args.tau_floor)
    code_execution(args, check_now=True)  # the answers are scored, code included
    report = run_loadtest(
        args.url,
        concurrencies=args.concurrency,
        requests=args.requests,
        policies=args.policies,
        max_tokens=args.max_tokens,
        api_key=args.api_key,
        model=args.model,
        adaptive_tau=args.adaptive_tau,
        tau_floor=args.tau_floor,
        timeout=args.timeout,
        deadline=args.deadline,
        seed=args.seed,
        repeats=args.repeats,
        log=lambda line: print(line, file=sys.stderr),
    )
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
    return 0


def _check_load(args) -> None:
    """The load itself, whichever engine serves it."""
    if args.requests < 1 or args.repeats < 1 or not args.concurrency or min(args.concurrency) < 1:
        raise UserError("--requests, --repeats and every --concurrency value must be >= 1")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    for flag in ("timeout", "deadline"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{flag} must be a finite number of seconds > 0, got {value}")


def _loadtest_vllm(args) -> int:
    from ..decode import check_tau
    from ..experiments.vllm_loadtest import format_table, run_vllm_bench
    from ..modeling import check_model_source
    from ..serve.vllm_launch import vllm_python

    if not args.checkpoint:
        raise UserError("--engine vllm needs --checkpoint DIR (the checkpoint the servers load)")
    _check_load(args)
    for tau in args.taus:
        check_tau(tau, "prob")
    check_model_source(args.checkpoint)
    code_execution(args, check_now=True)  # the answers are scored, code included
    vllm_python()
    report = run_vllm_bench(
        args.checkpoint,
        concurrencies=args.concurrency,
        requests=args.requests,
        repeats=args.repeats,
        taus=args.taus,
        max_tokens=args.max_tokens,
        timeout=args.timeout,
        seed=args.seed,
        vllm_args=args.vllm_args,
        log=lambda line: print(line, file=sys.stderr),
    )
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
    return 0
