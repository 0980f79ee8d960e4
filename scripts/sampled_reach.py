"""How far lossless sampling reaches: tokens per forward of seeded lossless sampling, counted.

    python scripts/sampled_reach.py runs/demo/mars --temperatures 1,0.7
    PYTHONPATH=/path/to/other/checkout python scripts/sampled_reach.py ...   # another version, same seeds

A sampled draft is kept where the AR model would have sampled it; how often that happens depends
on the verification rule as well as on the model, so two versions of the decoder compare here on
the same prompts and seeds. Every step reads its masks (the paper's rule), so nothing depends on
this machine's timings. Prints one row per data set and temperature: tokens per forward, and the
share of forwards that kept at least one draft.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "PYTHONPATH" not in os.environ:  # else the version named there
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import marslm  # noqa: E402
from marslm.decode import PAPER_RULE  # noqa: E402
from marslm.eval.sets import load_eval_set  # noqa: E402
from marslm.settings import floats, ints, strings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a MARS checkpoint")
    parser.add_argument("--data", type=strings, default="toy", help="eval sets (default toy)")
    parser.add_argument("--temperatures", type=floats, default="1,0.7")
    parser.add_argument("--seeds", type=ints, default="1,2,3", help="a run per seed; prompt i samples with seed + i")
    parser.add_argument("--n", type=int, default=16, help="prompts per data set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    model, tokenizer = marslm.load(args.model)
    print(f"decoder: {marslm.__file__}")
    print("| data | temperature | tokens | forwards | tok/fwd | forwards keeping a draft |")
    print("|---|---|---|---|---|---|")
    for data in args.data:
        prompts = [e.messages for e in load_eval_set(data, args.n).examples]
        for temperature in args.temperatures:
            steps = []
            for seed in args.seeds:
                out = marslm.generate(
                    model,
                    tokenizer,
                    prompts,
                    mode="lossless",
                    temperature=temperature,
                    seed=seed,
                    max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size,
                    **PAPER_RULE,
                )
                steps += [s for row in out.accepted_per_step for s in row]
            tokens, n, kept = sum(steps), len(steps), sum(s > 1 for s in steps)
            print(f"| {data} | {temperature} | {tokens} | {n} | {tokens / n:.3f} | {kept / n:.3f} |")


if __name__ == "__main__":
    main()
