"""``marslm show``: per-token pieces, runs of tokens accepted together, ANSI and HTML renderings.

The HTML page is also screenshotted with headless Chromium (Debian's ``chromium``; CI installs it
with scripts/ensure-chromium.sh) and the picture checked for the run shades.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from marslm import cli
from marslm.data import toy
from marslm.eval.show import (
    BLUE_RAMP,
    GREEN_RAMP,
    Shown,
    accepted_runs,
    render_ansi,
    render_html,
    shade,
    show_generation,
    token_pieces,
    xterm_rgb,
)
from tests.trained import TRAIN_N


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def test_pieces_concatenate_to_the_text_even_inside_multibyte_characters(tiny_tokenizer):
    text = "Café au lait? 3 plus 4 is 7 ✓ — naïve 🙂!"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    lone = [tiny_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in lone), "the test needs a character split over tokens"
    pieces = token_pieces(tiny_tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tiny_tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_accepted_runs_cover_the_shown_tokens():
    # The last forward accepted the end-of-turn token too, which is not shown.
    assert accepted_runs([1, 3, 2, 2], n_tokens=7) == [(0, 1), (1, 3), (4, 2), (6, 1)]
    assert accepted_runs([2, 1], n_tokens=2) == [(0, 2)]  # a forward that only accepted EOS


def test_shades_get_darker_and_alternate():
    assert shade(1, 0)[0] == BLUE_RAMP[0] and shade(1, 1)[0] == GREEN_RAMP[0]
    brightness = [sum(xterm_rgb(shade(k, 0)[0])) for k in range(1, len(BLUE_RAMP) + 1)]
    assert brightness == sorted(brightness, reverse=True)
    assert shade(99, 0) == shade(len(BLUE_RAMP), 0)


@pytest.fixture(scope="module")
def shown(trained_dirs) -> Shown:
    from marslm.modeling import load_model

    model, tokenizer, _ = load_model(str(trained_dirs["dir"] / "mars"))
    prompt = toy.make_split("train", TRAIN_N, seed=0)[7].messages[0]["content"]  # a memorised code item
    return show_generation(model, tokenizer, prompt, tau=0.6, max_new_tokens=96)


def test_show_generation_on_the_trained_model(shown):
    assert "".join(shown.pieces) == shown.text
    assert sum(length for _, length in shown.runs) == len(shown.token_ids) == len(shown.pieces)
    assert shown.forwards >= len(shown.runs) and shown.accepted >= len(shown.token_ids)
    assert max(length for _, length in shown.runs) > 1  # several tokens in one forward happened


def test_renderings(shown):
    ansi = render_ansi(shown, color=True)
    assert "\x1b[48;5;" in ansi and "tokens/forward" in ansi
    plain = render_ansi(shown, color=False)
    assert "\x1b" not in plain and "«" in plain
    assert plain.replace("«", "").replace("»", "").startswith(shown.text)
    page = render_html(shown)
    assert page.startswith("<!doctype html>") and "tokens/forward" in page and "Tokens accepted in one forward" in page
    assert "http" not in page  # self-contained


def test_show_cli(trained_dirs, tmp_path):
    prompt = toy.make_split("train", TRAIN_N, seed=0)[2].messages[0]["content"]
    rc, out, _ = run_cli(
        "show",
        "--model",
        trained_dirs["dir"] / "mars",
        "--prompt",
        prompt,
        "--tau",
        "0.8",
        "--max-new-tokens",
        32,
        "--html",
        tmp_path / "show.html",
        "--color",
        "never",
    )
    assert rc == 0 and "tokens/forward" in out and "\x1b" not in out
    assert (tmp_path / "show.html").read_text().startswith("<!doctype html>")
    rc, _, err = run_cli("show", "--model", tmp_path / "nope", "--prompt", "hi")
    assert rc == 2 and "model not found" in err and err.count("\n") == 1
    rc, _, err = run_cli("show", "--model", trained_dirs["dir"] / "mars", "--prompt", "hi", "--tau", "2")
    assert rc == 2 and "tau" in err


# ---------------------------------------------------------------------------- headless Chromium


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html_path: Path, png_path: Path, size=(1000, 600)) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                _chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--screenshot={png_path}",
                f"--window-size={size[0]},{size[1]}",
                html_path.resolve().as_uri(),
            ],
            check=True,
            timeout=60,
            capture_output=True,
        )


def test_html_screenshot_shows_the_shades(tmp_path):
    if _chromium() is None:
        pytest.skip("headless Chromium is not installed (run scripts/ensure-chromium.sh)")
    from PIL import Image

    # A known picture: runs of 1..5 tokens, twice, so both ramps appear at every length.
    lengths = [1, 2, 3, 4, 5, 5, 4, 3, 2, 1]
    pieces = [f"w{i} " for i in range(sum(lengths))]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    shown = Shown(
        prompt="Show me the runs.",
        text="".join(pieces),
        pieces=pieces,
        token_ids=list(range(len(pieces))),
        runs=list(zip(starts, lengths)),
        forwards=len(lengths),
        accepted=len(pieces),
        settings={"tau": 0.9, "metric": "prob", "block_size": 4, "mode": "threshold"},
    )
    page = tmp_path / "show.html"
    page.write_text(render_html(shown), encoding="utf-8")
    png = tmp_path / "show.png"
    screenshot(page, png)

    image = Image.open(png).convert("RGB")
    assert image.size == (1000, 600)
    counts = {rgb: n for n, rgb in image.getcolors(maxcolors=1 << 20)}
    assert max(counts.values()) < 0.97 * 1000 * 600  # not a blank page
    used = {xterm_rgb(shade(k, i % 2)[0]) for k in set(lengths) for i in range(2)}
    visible = {rgb for rgb in used if counts.get(rgb, 0) >= 100}  # big patches of the exact shade
    assert len(visible) >= 8, f"only {len(visible)} of the {len(used)} run shades are visible"
