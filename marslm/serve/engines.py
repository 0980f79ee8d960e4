"""The engines that serve a MARS checkpoint, by name: the one place that knows them apart.

An engine says which checkpoints it serves and what it supports, refuses a setting it cannot
honour, serves a checkpoint, and runs ``marslm loadtest``'s side of a load test. marslm's own
engine is the in-process scheduler of serve/engine.py behind serve/http.py; vLLM's is the MARS
plugin of marslm/vllm/, started in vLLM's own environment. A next engine (SGLang, say) is one
entry in ``ENGINES`` and the two functions it names; ``serve``, ``loadtest`` and their settings
ask this module.

Like vLLM's model registry, an entry names its functions as ``"module:function"`` and imports
them when called: the settings objects read ``NAMES`` at import, torch-free, and sit below the
servers they describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from ..errors import UserError


@dataclass(frozen=True)
class Engine:
    name: str
    serves: tuple[str, ...]  # the checkpoint kinds: "full" (MARS weights), "exact" (frozen + adapter)
    starts_servers: bool  # loadtest: starts its own servers on --checkpoint, or measures one at --url
    serve_with: str  # "module:function" (model, ServeConfig, extra args) -> exit code
    loadtest_with: str  # "module:function" (LoadtestConfig, log) -> (report, format_table)
    own_engine_only: bool = False  # refuses marslm's engine's settings (tau policies, drafters, limits)
    label: str = ""  # the engine's name in a sentence

    def refusals(self, config) -> list[str]:
        """What this engine cannot honour among a ``ServeConfig``'s settings, one line each."""
        if not self.own_engine_only:
            return []
        found = []
        if config.tau_policy != "fixed":
            found.append(f"--tau-policy adaptive is marslm's engine; {self.label} serves a fixed default tau")
        if config.threads is not None:
            found.append(f"--threads is marslm's engine; {self.label} sets its own threads")
        if config.drafting.draft_model is not None:
            found.append(
                f"--draft-model is marslm's engine; with {self.label}, its own draft-model speculative decoding "
                "serves a separate drafter, without the MARS plugin"
            )
        return found

    def serve(self, model: str, config, extra_args: list[str]) -> int:
        for refusal in self.refusals(config):
            raise UserError(refusal)
        return _function(self.serve_with)(model, config, extra_args)

    def loadtest(self, config, log):
        return _function(self.loadtest_with)(config, log)


def _function(path: str):
    module, name = path.split(":")
    return getattr(import_module(module), name)


ENGINES: dict[str, Engine] = {
    "marslm": Engine(
        "marslm",
        serves=("full", "exact"),
        starts_servers=False,
        serve_with="marslm.serve.http:serve_checkpoint",
        loadtest_with="marslm.bench.loadtest:loadtest",
    ),
    "vllm": Engine(
        "vllm",
        serves=("full", "exact"),
        starts_servers=True,
        serve_with="marslm.vllm.launch:serve_checkpoint",
        loadtest_with="marslm.bench.vllm_loadtest:loadtest",
        own_engine_only=True,
        label="vLLM",
    ),
}
NAMES = tuple(ENGINES)


def engine(name: str) -> Engine:
    """The engine called ``name``, or a one-line refusal naming the choices."""
    if name not in ENGINES:
        raise UserError(f"--engine must be one of {', '.join(NAMES)}, got {name!r}")
    return ENGINES[name]
