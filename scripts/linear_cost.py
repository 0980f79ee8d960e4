"""Why the first extra token of a step costs far more than the next ones on a CPU.

    python scripts/linear_cost.py CHECKPOINT [--rows 1,2,3,5,8,16,40] [--repeats 2000] [--profile]

Times one ``F.linear`` of each of the checkpoint's projection shapes (attention q/o, MLP up and
down, the LM head) with a batch of M rows, M the tokens a step feeds, and prints microseconds and
the ratio to M = 1 per shape, then the sum over one forward's linears: the BLAS answers M = 1
with a matrix-vector kernel and M >= 2 with a general matrix multiply whose fixed cost is higher.
``--profile`` also runs the checkpoint's cached forward with one and with two fed tokens under
``torch.profiler`` and prints the self CPU time per forward, in all and in the matrix multiplies.
A timing: run it alone.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig


def time_linear(rows: int, in_features: int, out_features: int, repeats: int) -> float:
    """Mean microseconds per call over ``repeats`` calls, after a warm-up."""
    x, w = torch.randn(1, rows, in_features), torch.randn(out_features, in_features)
    for _ in range(repeats // 10):
        F.linear(x, w)
    started = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, w)
    return (time.perf_counter() - started) / repeats * 1e6


def profile_forward(checkpoint: str, context: int = 128, forwards: int = 100) -> None:
    """Self CPU time per cached forward feeding one and two tokens, in all and in mm / addmm."""
    from torch.profiler import ProfilerActivity, profile

    from marslm.decode.kv import SlotCache
    from marslm.modeling import load_model

    model, _, _ = load_model(checkpoint)
    cache = SlotCache(capacity=2 * context)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, context)), cache=cache, use_cache=True, logits_to_keep=1)
        for width in (1, 2):
            inputs = {
                "input_ids": torch.randint(0, 100, (1, width)),
                "position_ids": (context + torch.arange(width))[None],
                "cache": cache,
                "use_cache": True,
                "logits_to_keep": width,
            }
            for _ in range(forwards // 5):  # warm-up
                model(**inputs)
                cache.crop(-width)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(forwards):
                    model(**inputs)
                    cache.crop(-width)
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events) / forwards / 1000
            matmul = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm"))
            matmul_ms = matmul / forwards / 1000
            print(f"{width} fed token(s): {total:.2f} ms per forward, of which mm / addmm {matmul_ms:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--rows", default="1,2,3,5,8,16,40", help="comma-separated row counts M")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="also profile the forward at 1 and 2 fed tokens")
    args = parser.parse_args()
    cfg = AutoConfig.from_pretrained(args.checkpoint)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    shapes = {  # name: (in, out, calls per forward)
        "q / o proj": (hidden, cfg.num_attention_heads * head_dim, 2 * layers),
        "k / v proj": (hidden, cfg.num_key_value_heads * head_dim, 2 * layers),
        "mlp gate / up": (hidden, cfg.intermediate_size, 2 * layers),
        "mlp down": (cfg.intermediate_size, hidden, layers),
        "lm head": (hidden, cfg.vocab_size, 1),
    }
    rows = [int(m) for m in args.rows.split(",")]
    blas = "MKL" if torch.backends.mkl.is_available() else "not MKL"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {blas}")
    print("| shape (in x out) | calls | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    total = [0.0] * len(rows)
    for name, (n_in, n_out, calls) in shapes.items():
        us = [time_linear(m, n_in, n_out, args.repeats) for m in rows]
        total = [t + calls * u for t, u in zip(total, us)]
        cells = " | ".join(f"{u:.1f} us ({u / us[0]:.2f}x)" for u in us)
        print(f"| {name} ({n_in} x {n_out}) | {calls} | {cells} |")
    cells = " | ".join(f"{t / 1000:.2f} ms ({t / total[0]:.2f}x)" for t in total)
    print(f"| one forward's linears | | {cells} |")
    if args.profile:
        profile_forward(args.checkpoint)


if __name__ == "__main__":
    main()
