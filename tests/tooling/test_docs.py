"""The docs stay runnable and true to the code: every ``marslm`` command line in README.md and
docs/*.md (not the studies in docs/log/) parses with marslm's own parser, every make target, file
path and link they name exists, every summary row of docs/results.md names a command that runs at
HEAD (or says it is gone and at which commit it ran), and every option that takes a list takes it
comma-separated, on every command.

A command in a fenced block must parse whole; one in running text (an inline code span) may leave
out required options, as prose names a command, but every option and choice it does give must be
real. A line is a template, checked for its subcommand alone, where it holds a placeholder
(``...``, ``a|b``, or an all-capitals word standing for a choice, such as ``NAME``). A command or
file that is gone on purpose says so on its line: "(removed after COMMIT)", "(gone after COMMIT)"
or "last at COMMIT" / "at commit COMMIT"."""

from __future__ import annotations

import argparse
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


def subparsers(parser=None) -> dict[str, argparse.ArgumentParser]:
    return (parser or build_parser())._subparsers._group_actions[0].choices


def complaint(argv: list[str], whole: bool) -> str:
    """What is wrong with ``marslm ARGV`` ("" where nothing is, or where it is a template); a
    command that is not ``whole`` (named in prose) may leave out required options."""
    if PLACEHOLDER.search(" ".join(argv)) or (argv and re.fullmatch(r"[A-Z][A-Z_]+", argv[0])):
        return ""
    if not argv or argv[0] not in subparsers():
        return "no such command"
    said = parse(argv)
    if said and not CHOICE_PLACEHOLDER.search(said) and (whole or "required" not in said):
        return said
    return ""


def problems(pages=PAGES) -> list[str]:
    found = []
    for page in pages:
        for number, argv, fenced, line in commands(page.read_text()):
            said = "" if GONE.search(line) else complaint(argv, fenced)
            if said:
                found.append(f"{page.name}:{number}: marslm {' '.join(argv)}: {said}")
    return found


def missing_files(pages=PAGES) -> list[str]:
    targets, found = make_targets(), []
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


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


# --- docs/results.md's summary: each row's command runs at HEAD, or says it is gone and when it ran

RESULTS = ROOT / "docs" / "results.md"
PROGRAMS = ("marslm", "make", "python", "bash", "pytest")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def table_cells(line: str) -> list[str]:
    """A markdown table row's cells; a ``|`` inside a code span does not split."""
    cells, cell, code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            code = not code
        if char == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    return [*cells, cell.strip()]


def summary_rows(page=RESULTS):
    """``(line number, {column: cell})`` of each row of the page's "## Summary" table."""
    lines, header, inside = page.read_text().splitlines(), None, False
    for number, line in enumerate(lines, 1):
        if line.startswith("## "):
            inside = line.strip() == "## Summary"
        elif inside and line.startswith("|") and not re.match(r"\|\s*-", line):
            if header is None:
                header = table_cells(line)
            else:
                yield number, dict(zip(header, table_cells(line)))


def command_problem(command: str) -> str:
    """What keeps one command (a code span: ``marslm ...``, ``make T``, ``python -m M``, ``bash
    PATH``, ``pytest PATH``, a script's path; after variable assignments or ``/usr/bin/time``) from
    running at HEAD, or ""."""
    words = shlex.split(command)
    program, rest = words[0], words[1:]
    if program == "marslm":
        return complaint(_argv(" ".join(rest)), whole=False)
    if program == "make":
        return "" if rest and rest[0] in make_targets() else f"no make target {' '.join(rest[:1])}"
    if program == "python" and rest[:1] == ["-m"]:
        module = ROOT / Path(*rest[1].split("."))
        return "" if module.with_suffix(".py").is_file() or (module / "__init__.py").is_file() else "no such module"
    path = rest[0].split("::")[0] if program in ("python", "bash", "pytest") and rest else program
    return "" if (ROOT / path).exists() else f"{path} does not exist"


def summary_problems(page=RESULTS) -> list[str]:
    found, rows = [], 0
    for number, row in summary_rows(page):
        rows += 1
        cell, commit = row.get("command", ""), row.get("commit", "")
        spans = list(re.finditer(r"`([^`]+)`", cell))
        named, previous = 0, ""
        for i, span in enumerate(spans):
            text = re.sub(r"^(?:[A-Z_]+=\S+ )*(?:/usr/bin/time(?: -v)? )?", "", span.group(1))
            if text.startswith("... ") and previous:  # the command before it, other options
                text = previous + " " + text[4:]
            if not (text.split()[0] in PROGRAMS or text.startswith("scripts/")):
                continue  # an argument named in prose (a checkpoint's path), not a command
            named += 1
            previous = " ".join(text.split()[:2])
            after = cell[span.end() : spans[i + 1].start() if i + 1 < len(spans) else len(cell)]
            if GONE.search(after):
                if not COMMIT.search(commit):
                    found.append(f"{page.name}:{number}: {text} is gone but the row names no commit it ran at")
                continue
            said = command_problem(text)
            if said:
                found.append(f"{page.name}:{number}: {text}: {said}")
        if not named:
            found.append(f"{page.name}:{number}: the row names no command ({cell!r})")
    if not rows:
        found.append(f"{page.name}: no summary table")
    return found


# --- options that take a list take it comma-separated, on every command

LIST_TYPES = {"floats": ("0.9,0.95", [0.9, 0.95]), "ints": ("1,8", [1, 8]), "strings": ("a,b", ["a", "b"])}
# vLLM's spelling, kept as `vllm serve` has it: several names after one flag
SPACE_SEPARATED = {("serve", "--served-model-name")}


def list_options(parser=None):
    """``(command, flag, action)`` of every option that takes several values."""
    for name, sub in subparsers(parser).items():
        for action in sub._actions:
            kind = getattr(action.type, "__name__", "")
            if action.option_strings and (kind in LIST_TYPES or action.nargs in ("+", "*")):
                yield name, action.option_strings[0], action


def required_argv(sub: argparse.ArgumentParser, but=None) -> list[str]:
    """Arguments that satisfy a subcommand's required ones (but the action ``but``)."""
    argv = []
    for action in sub._actions:
        if action.required and action is not but and action.nargs not in ("*", "...", argparse.REMAINDER):
            value = str(next(iter(action.choices))) if action.choices else "x"
            argv += [action.option_strings[0], value] if action.option_strings else [value]
    return argv


def list_option_problems(parser=None) -> list[str]:
    parser, found = parser or build_parser(), []
    for name, flag, action in list_options(parser):
        if (name, flag) in SPACE_SEPARATED:
            continue
        text, expected = LIST_TYPES.get(getattr(action.type, "__name__", ""), LIST_TYPES["floats"])
        argv, err = [name, *required_argv(subparsers(parser)[name], action), flag, text], io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                got = getattr(parser.parse_args(argv), action.dest)
        except SystemExit:
            found.append(f"marslm {name} {flag} {text}: {err.getvalue().strip().splitlines()[-1]}")
            continue
        flat = [x for item in got for x in (item if isinstance(item, list) else [item])]
        if flat != expected:
            found.append(f"marslm {name} {flag} {text} gives {got!r}, not {expected!r}")
    return found


def spaced_list_problems(pages=PAGES) -> list[str]:
    """A doc command that spells a list with spaces where an option would also take them."""
    several = {(name, flag) for name, flag, action in list_options() if action.nargs in ("+", "*")}
    found = []
    for page in pages:
        for number, argv, _, _ in commands(page.read_text()):
            for i, word in enumerate(argv[1:-2], 1):
                spaced = not argv[i + 2].startswith("-")
                if (argv[0], word) in several - SPACE_SEPARATED and spaced:
                    found.append(f"{page.name}:{number}: marslm {' '.join(argv)}: {word} takes a comma-separated list")
    return found


# --- every relative link reaches its page, and the heading it names


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def link_problems(pages=PAGES) -> list[str]:
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # another site
                path, _, anchor = target.partition("#")
                linked = (page.parent / path).resolve() if path else page
                if not linked.exists():
                    found.append(f"{page.name}:{number}: {path} does not exist")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    found.append(f"{page.name}:{number}: {path or page.name} has no heading #{anchor}")
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


def test_every_summary_row_names_a_command_that_runs_at_head():
    assert summary_problems() == []


SUMMARY = "## Summary\n\n| claim | measured | command | commit | section |\n|---|---|---|---|---|\n"


@pytest.mark.parametrize(
    "row, complaint",
    [
        ("| c | m | `scripts/table6.sh` | 0c71a57 | 2 |", "does not exist"),
        ("| c | m | `scripts/table6.sh` (gone after 1f8dba3) | - | 2 |", "names no commit"),
        ("| c | m | `make demos` | a50d7c4 | 1 |", "no make target"),
        ("| c | m | `/usr/bin/time marslm demo --preset plateau` | a50d7c4 | 1 |", "invalid choice"),
        ("| c | m | `marslm bench --cost-curve --save MODEL` | e3c02e1 | 6 |", "unrecognized arguments"),
        ("| c | m | `marslm bench --compile`; `... --contenders x --no-such` | e3c02e1 | 6 |", "unrecognized"),
        ("| c | m | `python -m marslm.bench.gone` | - | 7 |", "no such module"),
        ("| c | m | the bench, by hand | e3c02e1 | 6 |", "names no command"),
    ],
)
def test_a_planted_summary_defect_is_found(tmp_path, row, complaint):
    page = tmp_path / "results.md"
    page.write_text(SUMMARY + row + "\n\n## 1. Next\n\n| a | b |\n|---|---|\n| `scripts/gone.py` | x |\n")
    found = summary_problems(page)
    assert len(found) == 1 and complaint in found[0], found


def test_a_summary_row_whose_command_is_gone_passes_where_it_says_when_it_ran(tmp_path):
    page = tmp_path / "results.md"
    page.write_text(
        SUMMARY + "| c | m | `marslm demo --preset smollm2-long` (removed after 1f8dba3); `marslm demo --preset "
        "smollm2` | bc8f4be; aaa802d | 6 |\n| c | m | `MARSLM_X=1 pytest tests/tooling/test_docs.py -k x`; "
        "`make test` | every commit | 2 |\n"
    )
    assert summary_problems(page) == []


def test_every_list_option_takes_a_comma_separated_list():
    assert list_option_problems() == []
    taus = {(name, flag) for name, flag, action in list_options() if "tau" in flag}
    assert {("eval", "--tau"), ("bench", "--taus"), ("probe", "--tau")} <= taus


def test_no_doc_spells_a_list_with_spaces():
    assert spaced_list_problems() == []


def test_a_planted_space_separated_list_is_found(tmp_path):
    parser = argparse.ArgumentParser(prog="marslm")
    probe = parser.add_subparsers(dest="command").add_parser("probe")
    probe.add_argument("--model", required=True)
    probe.add_argument("--tau", type=float, nargs="+")
    found = list_option_problems(parser)
    assert len(found) == 1 and "probe --tau 0.9,0.95" in found[0]
    page = tmp_path / "page.md"
    page.write_text("```bash\nmarslm probe --model m --data d.jsonl --tau 0.9 0.95\n```\n")
    assert len(spaced_list_problems([page])) == 1


def test_every_link_reaches_its_page_and_heading():
    assert link_problems() == []


def test_a_planted_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "## The `--compile` step\n\n```bash\n# not a heading\n```\n[a](#the---compile-step) "
        "[b](#not-a-heading) [c](gone.md) [d](https://example.com/x.md#y)\n"
    )
    found = link_problems([page])
    assert len(found) == 2 and "#not-a-heading" in found[0] and "gone.md" in found[1], found
