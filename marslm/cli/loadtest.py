"""``marslm loadtest``: throughput, latency and accuracy of a server under load, per tau policy; its
options are ``LoadtestConfig``'s fields."""

from __future__ import annotations

import sys

from .common import add_unsafe_exec, code_execution, write_json

COMMAND = "loadtest"


def add_parser(sub) -> None:
    from ..bench.loadtest import LoadtestConfig
    from ..settings import add_options

    lt = sub.add_parser(
        COMMAND,
        help="throughput, latency and accuracy of a running server per tau policy",
        description="Send toy test-split prompts to a running `marslm serve` at each concurrency, "
        "under each tau policy (set through the server's admin API), and report throughput, "
        "latency percentiles, tokens per forward and accuracy.",
    )
    add_options(lt, LoadtestConfig, positional=("vllm_args",))
    add_unsafe_exec(lt)
    lt.set_defaults(run=run)


def run(args) -> int:
    from ..bench.loadtest import LoadtestConfig
    from ..serve.engines import engine
    from ..settings import from_args

    config = from_args(LoadtestConfig, args)
    code_execution(args, check_now=True)  # the answers are scored, code included
    report, format_table = engine(config.engine).loadtest(config, log=_progress)
    print(format_table(report))
    if config.json_path:
        write_json(config.json_path, report)
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr)
