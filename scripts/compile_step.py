"""``torch.compile`` on the decoding step's model call: milliseconds per step, eager against compiled.

    python scripts/compile_step.py CHECKPOINT

For tau 1 and 0.95 at batch 1 and 8 (toy prompts, 96 new tokens): the eager step, the compiled
step once warm, and how long the first compiled run took (the compilation). A timing: run it alone.
"""

from __future__ import annotations

import sys
import time

import torch

from marslm.decode import generate
from marslm.eval.sets import load_eval_set
from marslm.modeling import load_model


def main() -> None:
    model, tokenizer, _ = load_model(sys.argv[1])
    prompts = [e.messages for e in load_eval_set("toy", 16).examples]

    def run(m, tau, batch):
        started = time.perf_counter()
        out = generate(m, tokenizer, prompts[: max(batch, 8)], tau=tau, max_new_tokens=96, batch_size=batch)
        return time.perf_counter() - started, out.batch_forwards

    for tau in (1.0, 0.95):
        for batch in (1, 8):
            eager = min(run(model, tau, batch)[0] for _ in range(2))
            steps = run(model, tau, batch)[1]
            compiled = torch.compile(model, dynamic=True)
            compiled.name_or_path = model.name_or_path
            started = time.perf_counter()
            run(compiled, tau, batch)
            first = time.perf_counter() - started
            warm = min(run(compiled, tau, batch)[0] for _ in range(2))
            print(
                f"tau {tau} batch {batch}: eager {1000 * eager / steps:.2f} ms/step, compiled "
                f"{1000 * warm / steps:.2f} ms/step after a first run of {first:.1f} s",
                flush=True,
            )
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
