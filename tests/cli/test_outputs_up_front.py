"""Every command checks where its output goes before any work (issue 36, rule 5): an output under a
regular file, with a name the file system refuses, or in a directory that cannot be created is one
line on stderr naming the flag, exit 2, with no model loaded and no request sent; report files keep
the umask's permissions."""

from __future__ import annotations

import os

import pytest

from tests.cli.test_errors import assert_one_line_error, run
from tests.cli.test_refusals import NOWHERE, no_model_loads  # noqa: F401  (a fixture, used by name)

LONG = "x" * 300  # past NAME_MAX (255 bytes)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["probe", "--model", "{model}", "--data", "{data}", "--out", "{out}"], "--out"),
        (["bench", "--model", "{model}", "--json", "{out}"], "--json"),
        (["eval", "--model", "{model}", "--json", "{out}"], "--json"),
        (["eval", "--model", "{model}", "--markdown", "{out}"], "--markdown"),
        (["show", "--model", "{model}", "--prompt", "hi", "--html", "{out}"], "--html"),
        (["loadtest", "--url", NOWHERE, "--requests", "2", "--json", "{out}"], "--json"),
    ],
)
@pytest.mark.parametrize("where", ["under-a-file", "name-too-long"])
@pytest.mark.usefixtures("no_model_loads")
def test_outputs_are_checked_before_any_work(tiny_model_dir, tmp_path, capsys, args, flag, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "report.json" if where == "under-a-file" else tmp_path / f"{LONG}.json"
    data = tmp_path / "heldout.jsonl"
    data.write_text("")
    fill = {"{model}": str(tiny_model_dir), "{data}": str(data), "{out}": str(out)}
    args = [fill.get(a, a) for a in args]
    rc, _, err = run(capsys, *args)
    assert_one_line_error(rc, err, flag)
    assert not os.path.exists(out)


def test_an_output_directory_the_system_refuses_is_one_line(tmp_path, capsys):
    from marslm.errors import UserError
    from marslm.files import make_directory, output_directory

    with pytest.raises(UserError, match=r"--out .*: cannot create it"):
        make_directory(output_directory("/proc/marslm-demo", "--out"), "--out")
    with pytest.raises(UserError, match="at most 255"):
        output_directory(tmp_path / LONG, "--out")


def test_demo_refuses_an_output_it_cannot_create(capsys):
    rc, _, err = run(capsys, "demo", "--preset", "smollm2-quick", "--out", "/proc/marslm-demo")
    assert_one_line_error(rc, err, "--out /proc/marslm-demo")


def test_report_files_keep_the_umask(tmp_path):
    from marslm.files import write_json_atomically

    old = os.umask(0o022)
    try:
        write_json_atomically(tmp_path / "report.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o644
