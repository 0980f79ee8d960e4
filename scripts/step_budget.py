"""Where a decoding step's time goes: the model's forward against the rest, for marslm and HF ``generate``.

    python scripts/step_budget.py CHECKPOINT [toy|reworded] [--repeats 5] [--batch-sizes 1,8,32] [--json OUT]

Wraps ``model.forward`` with a timer, then decodes the same prompts with ``marslm.generate``
(tau 1; tau 0.95 with adaptive and with fixed width; lossless) and with HF ``generate`` (KV cache,
greedy) at batch 1 (8 prompts) and at batch 8 and 32 (32 prompts, rows refilled), 128 new tokens.
Per setting: milliseconds per step, the forward's share and the rest (host work), tokens fed per
step (prompts included) and tokens per second, each the median of interleaved repeats. A timing:
run it alone, and compare settings within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from marslm.bench.speed import _run_hf
from marslm.chat import encode_prompt
from marslm.decode import generate
from marslm.eval.sets import load_eval_set
from marslm.modeling import load_model

MAX_NEW_TOKENS = 128
MARS_SETTINGS = {
    "tau 1": {"tau": 1.0},
    "tau 0.95 adaptive": {"tau": 0.95, "adaptive_width": True},
    "tau 0.95 fixed": {"tau": 0.95, "adaptive_width": False},
    "lossless": {"mode": "lossless"},
}


class ForwardTimer:
    """Counts the model's forwards, the time spent in them and the tokens they were fed."""

    def __init__(self, model):
        self.inner = model.forward
        model.forward = self
        self.reset()

    def reset(self):
        self.seconds, self.fed, self.calls = 0.0, 0, 0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        self.fed += kwargs["input_ids"].numel()
        self.calls += 1
        return out


def measure(timer, decode) -> dict:
    timer.reset()
    started = time.perf_counter()
    tokens, tokens_per_forward = decode()
    seconds = time.perf_counter() - started
    steps = timer.calls
    return {
        "steps": steps,
        "ms_per_step": 1000 * seconds / steps,
        "forward_ms": 1000 * timer.seconds / steps,
        "other_ms": 1000 * (seconds - timer.seconds) / steps,
        "fed_per_step": timer.fed / steps,
        "tok_s": tokens / seconds,
        "tpf": tokens_per_forward,
    }


def median_row(runs: list[dict]) -> dict:
    """Each field's median over the repeats (a slow repeat on a shared machine moves no median)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("data", nargs="?", default="toy", choices=("toy", "reworded"))
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians are reported")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated, from 1, 8, 32 (default all)")
    parser.add_argument("--json", help="write the rows as JSON to this file")
    args = parser.parse_args()

    model, tokenizer, _ = load_model(args.checkpoint)
    timer = ForwardTimer(model)
    messages = [e.messages for e in load_eval_set(args.data, 64).examples]
    rows = []
    for batch in sorted({int(b) for b in args.batch_sizes.split(",")}):
        prompts = messages[:8] if batch == 1 else messages[:32]
        prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]

        def mars(settings, ids=prompt_ids, batch=batch):
            out = generate(model, tokenizer, ids, max_new_tokens=MAX_NEW_TOKENS, batch_size=batch, **settings)
            return sum(map(len, out.token_ids)), out.tokens_per_forward

        def hf_decode(ids=prompt_ids, b=batch):
            return _run_hf(model, tokenizer, ids, b, MAX_NEW_TOKENS, {})["tokens"], 1.0

        decoders = {name: (lambda s=settings: mars(s)) for name, settings in MARS_SETTINGS.items()}
        decoders["HF generate"] = hf_decode
        for decode in decoders.values():  # warm-up
            decode()
        runs = {name: [] for name in decoders}
        for _ in range(args.repeats):  # interleaved, so a slow spell slows every decoder alike
            for name, decode in decoders.items():
                runs[name].append(measure(timer, decode))
        for name in decoders:
            row = {"batch": batch, "setting": name, **median_row(runs[name])}
            rows.append(row)
            print(
                f"batch {row['batch']:2d} {row['setting']:18s} {row['ms_per_step']:6.2f} ms/step "
                f"(forward {row['forward_ms']:.2f}, rest {row['other_ms']:.2f}), fed {row['fed_per_step']:.0f} "
                f"tokens/step, {row['tok_s']:.0f} tok/s, {row['tpf']:.2f} tok/fwd",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
