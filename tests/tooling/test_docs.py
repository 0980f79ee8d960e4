"""The docs stay runnable: every ``marslm`` command line in README.md and docs/*.md (not the
studies in docs/log/) parses with marslm's own parser, and every make target and file path they
name exists.

A command in a fenced block must parse whole; one in running text (an inline code span) may leave
out required options, as prose names a command, but every option and choice it does give must be
real. A line is a template, checked for its subcommand alone, where it holds a placeholder
(``...``, ``a|b``, or an all-capitals word standing for a choice, such as ``NAME``). A command or
file that is gone on purpose says so on its line: "(removed after COMMIT)", "(gone after COMMIT)"
or "last at COMMIT" / "at commit COMMIT"."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from marslm.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GONE = re.compile(r"\((?:removed|gone) after \w+|last at \w+|at commit \w+")
PLACEHOLDER = re.compile(r"\.\.\.|\w\|\w")
CHOICE_PLACEHOLDER = re.compile(r"invalid choice: '[A-Z][A-Z_]+'")
# in a fenced block: a line that runs marslm (after a prompt, a venv path or variable assignments)
FENCED = re.compile(r"^\s*(?:\$ )?(?:[A-Z_]+=\S+ )*(?:\S*/)?(?:\.venv/bin/)?marslm ((?:\w[\w-]*).*)$")
INLINE = re.compile(r"`(?:\S*/)?marslm ([a-z][^`]*)`")


def commands(text: str):
    """``(line number, argv, fenced, the line)`` of each marslm command line in a page."""
    lines, fenced, i = text.splitlines(), False, 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            start, whole = i, line
            while whole.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                whole = whole.rstrip()[:-1] + " " + lines[i].strip()
            match = FENCED.match(whole)
            if match:
                yield start + 1, _argv(match.group(1)), True, whole
        else:
            for match in INLINE.finditer(line):
                yield i + 1, _argv(match.group(1)), False, line[match.end() : match.end() + 24] + line
        i += 1


def _argv(command: str) -> list[str]:
    """The arguments of one command: its comment, redirections and what a pipe or ``&&`` runs after
    it left out."""
    command = re.split(r"\s(?:#|&&|\|\||\||;|>|2>)\s?", " " + command + " ")[0]
    return shlex.split(command)


def parse(argv: list[str]) -> str:
    """marslm's parser's complaint about ``argv``, or "" where it takes them."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        return err.getvalue().strip() if exc.code else ""
    return ""


def problems(pages=PAGES) -> list[str]:
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    found = []
    for page in pages:
        for number, argv, fenced, line in commands(page.read_text()):
            where = f"{page.name}:{number}: marslm {' '.join(argv)}"
            if GONE.search(line):
                continue
            if PLACEHOLDER.search(" ".join(argv)) or (argv and re.fullmatch(r"[A-Z][A-Z_]+", argv[0])):
                continue
            if not argv or argv[0] not in subcommands:
                found.append(f"{where}: no such command")
                continue
            complaint = parse(argv)
            if complaint and not CHOICE_PLACEHOLDER.search(complaint) and (fenced or "required" not in complaint):
                found.append(f"{where}: {complaint}")
    return found


def missing_files(pages=PAGES) -> list[str]:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if GONE.search(line):
                continue
            for match in re.finditer(r"`((?:marslm|scripts|docs|tests|configs|\.ci)/[\w/.\-]*)`", line):
                path = match.group(1).rstrip("/")
                if not (ROOT / path).exists() and not (page.parent / path).exists():
                    found.append(f"{page.name}:{number}: {path} does not exist")
            for match in re.finditer(r"`make ([\w-]+)", line):
                if match.group(1) not in targets:
                    found.append(f"{page.name}:{number}: no make target {match.group(1)}")
    return found


def test_every_command_in_the_docs_parses():
    assert problems() == []


def test_every_file_and_make_target_the_docs_name_exists():
    assert missing_files() == []


@pytest.mark.parametrize(
    "planted, complaint",
    [
        ("```bash\nmarslm generate --model m --prompt x --no-such-flag\n```\n", "unrecognized arguments"),
        ("Run `marslm bench --cost-curve --save MODEL` once.\n", "unrecognized arguments"),
        ("Run `marslm demo --preset plateau`.\n", "invalid choice"),
        ("```bash\nmarslm serve --model m \\\n   --adaptive-width\n```\n", "unrecognized arguments"),
        ("Then `marslm frobnicate --model m`.\n", "no such command"),
    ],
)
def test_a_planted_defect_is_found(tmp_path, planted, complaint):
    page = tmp_path / "page.md"
    page.write_text(planted)
    found = problems([page])
    assert len(found) == 1 and complaint in found[0]


def test_a_line_that_says_the_command_is_gone_and_a_template_pass(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "`marslm demo --preset smollm2-long` (removed after 1f8dba3)\n`marslm serve --engine NAME`\n"
        "`marslm train ar|mars`\n`scripts/gone.py` (gone after 1f8dba3)\n"
    )
    assert problems([page]) == [] and missing_files([page]) == []
    page.write_text("`scripts/gone.py` and `make nothing`\n")
    assert len(missing_files([page])) == 2


LENGTH_BOUNDS = {"README.md": 250, "docs/results.md": 500}  # a newcomer's page; what holds today


@pytest.mark.parametrize("page", LENGTH_BOUNDS)
def test_the_front_pages_stay_short(page):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= LENGTH_BOUNDS[page], f"{page} has {lines} lines; move detail to docs/ or docs/log/"
