"""``marslm show``: one generation, with the tokens accepted in the same forward shaded together.

The picture of the paper's Figure 1: each forward pass of the sliding window accepts a run of
tokens; a run is drawn as one shaded box, darker for longer runs, so the boilerplate the model
emits several tokens at a time stands out from the content it takes one token at a time.
Neighbouring runs alternate between a blue and a green ramp of the same darkness, so two runs
of equal length side by side stay two boxes; one-token forwards (plain AR steps) stay neutral
(light grey / white).

Two renderings of the same :class:`Shown`: ANSI 256-colour backgrounds for a terminal, and a
self-contained HTML page (inline CSS, no external resources) with a legend and the stats.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

# xterm-256 colour indices, light to dark; index k-1 shades a run of k tokens (k >= len: darkest).
# A one-token forward (plain AR) stays neutral, light grey or white, so multi-token runs stand out.
# The HTML page uses the same colours (their RGB values), so both renderings look alike.
BLUE_RAMP = (255, 153, 117, 75, 33, 27, 18)
GREEN_RAMP = (231, 157, 120, 77, 34, 28, 22)
LIGHT_TEXT_FROM = 5  # runs of this many tokens or more get white text (dark background)
ANSI_RESET = "\x1b[0m"


def xterm_rgb(index: int) -> tuple[int, int, int]:
    """RGB of an xterm-256 colour from the 6x6x6 cube (16..231) or the grey ramp (232..255)."""
    if 16 <= index <= 231:
        levels = (0, 95, 135, 175, 215, 255)
        i = index - 16
        return levels[i // 36], levels[i // 6 % 6], levels[i % 6]
    if 232 <= index <= 255:
        v = 8 + 10 * (index - 232)
        return v, v, v
    raise ValueError(f"only cube and grey xterm colours are used here, got {index}")


def hex_colour(index: int) -> str:
    return "#{:02x}{:02x}{:02x}".format(*xterm_rgb(index))


def shade(run_length: int, run_index: int) -> tuple[int, bool]:
    """(xterm background colour, light text?) of the ``run_index``-th run, ``run_length`` tokens long."""
    ramp = BLUE_RAMP if run_index % 2 == 0 else GREEN_RAMP
    level = min(max(run_length, 1), len(ramp)) - 1
    return ramp[level], run_length >= LIGHT_TEXT_FROM


@dataclass
class Shown:
    prompt: str
    text: str  # the generation, as generate() decodes it
    pieces: list[str]  # one display string per new token; "".join(pieces) == text
    token_ids: list[int]
    runs: list[tuple[int, int]]  # (first token, length) of each forward's accepted run, in order
    forwards: int
    accepted: int  # tokens accepted over all forwards (the end-of-turn token included)
    settings: dict  # tau, metric, block_size, ...

    @property
    def tokens_per_forward(self) -> float:
        return self.accepted / self.forwards if self.forwards else 0.0


# ---------------------------------------------------------------------------- pieces and runs


def token_pieces(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The text each token adds, so that the pieces concatenate to ``decode(token_ids)`` exactly.

    Decoding a token on its own is wrong for byte-level BPE: a character of several bytes can be
    split over tokens, and a lone piece decodes to U+FFFD. So decode growing prefixes and take
    differences; a token that ends inside a character shows nothing, and the token that completes
    it shows the whole character. (Quadratic in the length; fine for one answer.)
    """

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    pieces, emitted = [], ""
    for end in range(1, len(token_ids) + 1):
        text = decode(token_ids[:end])
        if text.endswith("\ufffd") or not text.startswith(emitted):
            pieces.append("")  # incomplete character (or a prefix that decodes differently)
            continue
        pieces.append(text[len(emitted) :])
        emitted = text
    full = decode(token_ids)
    if pieces and full.startswith(emitted):
        pieces[-1] += full[len(emitted) :]  # whatever the last tokens still owe
    elif pieces:  # prefixes did not decode consistently: keep the text exact
        pieces = [""] * (len(pieces) - 1) + [full]
    return pieces


def accepted_runs(accepted_per_step: list[int], n_tokens: int) -> list[tuple[int, int]]:
    """``(first token, length)`` of each forward's run over the ``n_tokens`` shown tokens.

    ``accepted_per_step`` counts the end-of-turn token, which is not shown: runs are cut at the
    end of the shown tokens, and a forward that only accepted the end of turn leaves no run.
    """
    runs, start = [], 0
    for count in accepted_per_step:
        length = min(count, n_tokens - start)
        if length > 0:
            runs.append((start, length))
        start += count
    return runs


def show_generation(
    model,
    tokenizer,
    prompt: str,
    *,
    tau: float = 0.9,
    metric: str = "prob",
    block_size: int | None = None,
    max_new_tokens: int = 256,
    cache: str = "cursor",
    mode: str = "threshold",
    use_last_mask: bool = True,
) -> Shown:
    """Decode ``prompt`` (a user message) once and keep what the rendering needs."""
    from ..decode import generate
    from ..modeling import checkpoint_facts

    block_size = block_size or checkpoint_facts(model, tokenizer).block_size
    result = generate(
        model,
        tokenizer,
        [prompt],
        tau=tau,
        metric=metric,
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        cache=cache,
        mode=mode,
        use_last_mask=use_last_mask,
    )
    ids, steps = result.token_ids[0], result.accepted_per_step[0]
    return Shown(
        prompt=prompt,
        text=result.texts[0],
        pieces=token_pieces(tokenizer, ids),
        token_ids=ids,
        runs=accepted_runs(steps, len(ids)),
        forwards=len(steps),
        accepted=sum(steps),
        settings={
            "tau": tau,
            "metric": metric,
            "block_size": block_size,
            "mode": mode,
            "model": getattr(model, "name_or_path", ""),
        },
    )


def stats_line(shown: Shown) -> str:
    s = shown.settings
    return (
        f"{len(shown.token_ids)} tokens in {shown.forwards} forwards: {shown.tokens_per_forward:.2f} tokens/forward "
        f"(tau={s['tau']:g}, metric={s['metric']}, B={s['block_size']}"
        f"{', ' + s['mode'] if s.get('mode', 'threshold') != 'threshold' else ''})"
    )


# ---------------------------------------------------------------------------- terminal


def _ansi(text: str, background: int, light: bool) -> str:
    """``text`` on a coloured background; colours close before each newline so no line end is painted."""
    start = f"\x1b[48;5;{background}m\x1b[38;5;{231 if light else 16}m"
    return "\n".join(start + line + ANSI_RESET if line else "" for line in text.split("\n"))


def render_ansi(shown: Shown, color: bool = True) -> str:
    """The generation for a terminal, then a legend and the stats.

    Without colour, runs of two or more tokens are wrapped in « » instead.
    """
    out = []
    for i, (start, length) in enumerate(shown.runs):
        text = "".join(shown.pieces[start : start + length])
        if color:
            out.append(_ansi(text, *shade(length, i)))
        else:
            out.append(f"«{text}»" if length > 1 else text)
    longest = max((length for _, length in shown.runs), default=1)
    if color:
        samples = " ".join(
            _ansi(f" {k} ", *shade(k, 0)) + _ansi(f" {k} ", *shade(k, 1)) for k in range(1, max(longest, 2) + 1)
        )
        legend = f"tokens accepted per forward: {samples}"
    else:
        legend = "«...»: tokens accepted together in one forward"
    return "".join(out) + "\n\n" + legend + "\n" + stats_line(shown)


# ---------------------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #111; background: #fff; }
h1 { font-size: 20px; margin: 0 0 12px; }
.prompt { margin: 0 0 12px; white-space: pre-wrap; }
.text { font: 16px/1.9 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap;
        border: 1px solid #ccc; border-radius: 6px; padding: 12px; margin: 0 0 16px; }
.run { border-radius: 3px; padding: 2px 0; }
.legend { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; margin: 0 0 12px; }
.swatch { display: inline-block; min-width: 28px; text-align: center; padding: 3px 6px;
          border-radius: 3px; font: 14px ui-monospace, monospace; box-shadow: inset 0 0 0 1px #bbb; }
.stats { color: #333; }
"""


def _run_style(length: int, index: int) -> str:
    background, light = shade(length, index)
    return f"background:{hex_colour(background)};color:{'#ffffff' if light else '#000000'}"


def render_html(shown: Shown, title: str = "MARS generation") -> str:
    """A self-contained page: the prompt, the shaded generation, a legend (run length -> shade), the stats."""
    runs = []
    for i, (start, length) in enumerate(shown.runs):
        tokens = "".join(
            f'<span class="tok" title="token {start + j}, id {shown.token_ids[start + j]}">'
            f"{html.escape(shown.pieces[start + j])}</span>"
            for j in range(length)
        )
        runs.append(
            f'<span class="run len{length}" style="{_run_style(length, i)}" '
            f'title="forward {i + 1}: {length} token{"s" if length > 1 else ""}">{tokens}</span>'
        )
    longest = max((length for _, length in shown.runs), default=1)
    swatches = "".join(
        f'<span class="swatch" style="{_run_style(k, 0)}">{k}</span>'
        f'<span class="swatch" style="{_run_style(k, 1)}">{k}</span>'
        for k in range(1, max(longest, 2) + 1)
    )
    s = shown.settings
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="prompt"><b>Prompt:</b> {html.escape(shown.prompt)}</p>
<pre class="text">{"".join(runs)}</pre>
<div class="legend"><span>Tokens accepted in one forward:</span>{swatches}
<span>(darker = more tokens; neighbouring forwards alternate blue / green)</span></div>
<p class="stats"><b>{len(shown.token_ids)}</b> tokens, <b>{shown.forwards}</b> forwards,
<b>{shown.tokens_per_forward:.2f}</b> tokens/forward &middot; tau={s["tau"]:g}, metric={html.escape(str(s["metric"]))},
B={s["block_size"]} &middot; {html.escape(str(s.get("model", "")))}</p>
</body></html>
"""
