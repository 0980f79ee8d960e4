"""The CLI parses without torch: ``marslm --help``, every command's help and a bad command line
answer before torch or transformers is imported (the parsers import only torch-free modules)."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in a fresh interpreter: this test process has long imported torch.
SCRIPT = """
import json, sys
from importlib import import_module
from marslm.cli import METHOD, TOOLING, build_parser, main

build_parser()
heavy = {"after the parser": [m for m in ("torch", "transformers") if m in sys.modules]}
commands = [import_module(f"marslm.cli.{name}").COMMAND for name in METHOD + TOOLING]
exits = {}
for argv in [["--help"], ["train", "ar", "--no-such-flag"], ["train", "ar", "--block-size", "two"]] + [
    [command, "--help"] for command in commands
]:
    try:
        exits[" ".join(argv)] = main(argv)
    except SystemExit as exc:
        exits[" ".join(argv)] = exc.code
heavy["after the commands"] = [m for m in ("torch", "transformers") if m in sys.modules]
print(json.dumps({"heavy": heavy, "exits": exits, "commands": len(METHOD + TOOLING)}))
"""


def test_the_parser_help_and_a_bad_flag_need_no_torch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["heavy"] == {"after the parser": [], "after the commands": []}
    exits = report["exits"]
    assert exits.pop("train ar --no-such-flag") == 2
    assert exits.pop("train ar --block-size two") == 2
    assert len(exits) == report["commands"] + 1 and set(exits.values()) == {0}
