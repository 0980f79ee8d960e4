"""What the default fallback reads, counted rather than timed: forwards, masked forwards and columns fed.

    python scripts/fallback_counts.py runs/demo/mars --costs 1:1.27,2:1.3,4:1.3,8:1.6
    PYTHONPATH=/path/to/other/checkout python scripts/fallback_counts.py ...   # another version, same counts

The auto mask batch limit decides from timed step costs, so its decisions move with the machine's
load. Here the costs are fixed (``--costs``, batch size: ratio to a one-token step) and everything
else is counted, so two versions of the decoder, or two cost curves, compare exactly on a loaded
machine. Prompts are decoded in chunks of the batch size, one ``generate`` call per chunk, as
``marslm bench`` decodes them; the decoder is the default one (adaptive width and the auto limit).
Prints one row per data set, mode and batch size; ``tok/row-fwd`` is tokens per row per forward.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "PYTHONPATH" not in os.environ:  # else the version named there
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import marslm  # noqa: E402
from marslm.decode import costs  # noqa: E402
from marslm.eval.sets import load_eval_set  # noqa: E402
from marslm.modeling import checkpoint_facts  # noqa: E402
from marslm.settings import ints, strings  # noqa: E402


def parse_costs(text: str) -> dict[int, float]:
    pairs = (item.split(":") for item in text.split(","))
    return {int(batch): float(ratio) for batch, ratio in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a MARS checkpoint")
    parser.add_argument(
        "--costs",
        type=parse_costs,
        default="1:1.27,2:1.3,4:1.3,8:1.43",
        help="fixed masked step costs, batch:ratio,... (every batch size measured must be named)",
    )
    parser.add_argument("--data", type=strings, default="toy,reworded", help="eval sets (default toy,reworded)")
    parser.add_argument("--modes", type=strings, default="threshold,lossless,hybrid")
    parser.add_argument("--batch-sizes", type=ints, default="1,8")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--tau", type=float, default=0.95)
    args = parser.parse_args()

    fixed = args.costs
    costs.masked_step_costs = lambda model, n_masks, sizes, **_: {b: fixed[b] for b in sizes}
    model, tokenizer = marslm.load(args.model)
    mask_id = checkpoint_facts(model, tokenizer).mask_token_id
    fed = []
    model.register_forward_pre_hook(lambda _, a, k: fed.append(k["input_ids"]), with_kwargs=True)
    print(f"decoder: {marslm.__file__}\ncosts: {fixed}")
    print("| data | mode | batch | forwards | masked forwards | columns fed | tok/row-fwd |")
    print("|---|---|---|---|---|---|---|")
    for data in args.data:
        prompts = [e.messages for e in load_eval_set(data, args.n).examples]
        for batch in args.batch_sizes:
            for mode in args.modes:
                fed.clear()
                # each group is a workload of its own: its limit starts afresh, at the prior
                for kept in ("LIMITS_ATTR", "BOUGHT_ATTR"):  # the limit, or an older decoder's mean
                    vars(model).pop(getattr(costs, kept, ""), None)
                tokens = forwards = 0
                for start in range(0, len(prompts), batch):
                    out = marslm.generate(
                        model,
                        tokenizer,
                        prompts[start : start + batch],
                        batch_size=batch,
                        mode=mode,
                        tau=args.tau,
                        max_new_tokens=128,
                    )
                    tokens += sum(map(sum, out.accepted_per_step))
                    forwards += sum(out.forwards)
                masked = sum(int((ids == mask_id).any()) for ids in fed)
                columns = sum(ids.numel() for ids in fed)
                print(f"| {data} | {mode} | {batch} | {len(fed)} | {masked} | {columns} | {tokens / forwards:.2f} |")


if __name__ == "__main__":
    main()
