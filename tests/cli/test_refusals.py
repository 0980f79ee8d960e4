"""Settings that would run and mislead (or end in a traceback) are refused up front: one line on
stderr, exit 2, before any model loads or any load is sent, and nothing written."""

from __future__ import annotations

import pytest

from tests.cli.test_errors import assert_one_line_error, run

NOWHERE = "http://127.0.0.1:9"  # nothing listens: a loadtest that got as far as sending would say so


@pytest.fixture
def no_model_loads(monkeypatch):
    from marslm import modeling

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(modeling, "load_model", refuse)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["serve", "--seed", "-1"], "--seed must be an integer in 0..2^63-1, got -1"),
        (["bench", "--ar-model", "{mars}", "--max-new-tokens", "0", "--json", "{out}"], "--max-new-tokens must be >="),
        (["bench", "--cost-curve", "--contexts", "999999", "--json", "{out}"], "exceeds the model's context of 1024"),
        (["eval", "--block-size", "99", "--json", "{out}"], "block size must be in 1..4 (the block size the model"),
        (["bench", "--ar-model", "{mars}", "--block-size", "5", "--json", "{out}"], "block size must be in 1..4"),
        (["eval", "--block-size", "2,5", "--json", "{out}"], "got 5"),
    ],
)
def test_model_commands_refuse_before_loading(trained_dirs, capsys, tmp_path, no_model_loads, args, fragment):
    mars, out = trained_dirs["dir"] / "mars", tmp_path / "report.json"
    args = [a.replace("{mars}", str(mars)).replace("{out}", str(out)) for a in args]
    rc, _, err = run(capsys, args[0], "--model", mars, *args[1:])
    assert_one_line_error(rc, err, fragment)
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
        (["--deadline", "-1"], "--deadline must be a finite number of seconds > 0, got -1"),
        (["--deadline", "nan"], "--deadline must be a finite number of seconds > 0"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--policies", "fixed-nan"], "bad policy 'fixed-nan' (tau must be a finite number"),
        (["--policies", "fixed-1.5"], "bad policy 'fixed-1.5'"),
        (["--tau-floor", "nan"], "--tau-floor: tau must be a finite number"),
        (["--adaptive-tau", "2"], "--adaptive-tau: tau for the prob metric must be in (0, 1], got 2"),
    ],
)
def test_loadtest_refuses_before_sending(capsys, tmp_path, flags, fragment):
    rc, _, err = run(capsys, "loadtest", "--url", NOWHERE, "--json", tmp_path / "report.json", *flags)
    assert_one_line_error(rc, err, fragment)
    assert "cannot reach" not in err and not (tmp_path / "report.json").exists()
