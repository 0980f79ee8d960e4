"""``marslm loadtest``: throughput, latency and accuracy of a server under load, per tau policy; its
options are ``LoadtestConfig``'s fields."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .common import add_unsafe_exec, code_execution, write_json

if TYPE_CHECKING:
    from ..bench.loadtest import LoadtestConfig

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
    from ..bench.loadtest import LoadtestConfig, format_table, run_loadtest
    from ..settings import from_args

    config = from_args(LoadtestConfig, args)
    if config.engine == "vllm":
        return _loadtest_vllm(args, config)
    code_execution(args, check_now=True)  # the answers are scored, code included
    _report(config, run_loadtest(config, log=_progress), format_table)
    return 0


def _loadtest_vllm(args, config: LoadtestConfig) -> int:
    from ..bench.vllm_loadtest import format_table, run_vllm_bench
    from ..modeling import check_model_source
    from ..vllm.launch import vllm_python

    check_model_source(config.checkpoint)
    code_execution(args, check_now=True)  # the answers are scored, code included
    vllm_python()
    _report(config, run_vllm_bench(config, log=_progress), format_table)
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr)


def _report(config: LoadtestConfig, report: dict, format_table) -> None:
    print(format_table(report))
    if config.json_path:
        write_json(config.json_path, report)
